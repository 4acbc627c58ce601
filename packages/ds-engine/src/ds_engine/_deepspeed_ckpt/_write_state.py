"""What the DeepSpeed-layout writers need from a ds engine, gathered onto the writing rank.

[Note: writing DeepSpeed's layout]
Every layout DeepSpeed 0.19 writes is built from the same few things: each trainable
parameter's fp32 master and elementwise optimizer state (Adam's ``exp_avg``/``exp_avg_sq``) as
whole flat tensors, the param groups (member names, hyper-parameters, the scalar ``step``), the
module's weights in the model dtype, and the loss scaler. :func:`gather_state` collects them from
ds's ZeRO optimizer (any stage): every rank hands its :class:`~ds_zero.TensorShard` pieces to the
others of its data-parallel group, and each parameter is assembled whole. The layout modules
(``_write_zero``, ``_write_stage0``, ``_write_pipe``, ``_write_moe``) then cut the whole tensors
the way DeepSpeed would for the target world size and stage.

A group's members are ordered as the module registers them (``named_parameters()``): the order
DeepSpeed flattens a group in when the group was built from ``named_parameters()``, as usual.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ds_engine._deepspeed_ckpt._pickle import (
    DeepSpeedCheckpointError,
    DynamicLossScalerState,
    LossScalerState,
)
from ds_zero import GatheredParameters, Stage3Optimizer, ZeroOptimizer

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping

__all__ = [
    "GroupState",
    "WriteState",
    "dp_group",
    "dp_rank",
    "gather_state",
    "group_step",
    "loss_scaler_state",
    "module_weights",
    "param_groups",
    "zero_optimizer_of",
]


@dataclass
class GroupState:
    """One optimizer param group: its trainable members, hyper-parameters and ``step``."""

    names: list[str]
    hyper: dict[str, Any]
    step: torch.Tensor | None


@dataclass
class WriteState:
    """Everything a DeepSpeed layout is cut from (whole tensors, on the writing rank).

    Attributes:
        fp32: each trainable parameter's fp32 master, flat.
        moments: each trainable parameter's elementwise optimizer state, flat, by key.
        shapes: each trainable parameter's shape.
        groups: the param groups holding trainable parameters, in optimizer order.
        scaler: DeepSpeed's loss-scaler object (a pickling stand-in).
        cur_iter: the loss scaler's iteration count (the steps taken, skipped ones included).
        clip: the configured gradient clipping (None: unknown, left out of the files so
            DeepSpeed keeps its configured one).
    """

    fp32: dict[str, torch.Tensor]
    moments: dict[str, dict[str, torch.Tensor]]
    shapes: Mapping[str, tuple[int, ...]]
    groups: list[GroupState]
    scaler: LossScalerState
    cur_iter: int
    clip: float | None
    module: OrderedDict[str, torch.Tensor] = field(default_factory=OrderedDict)

    def state_keys(self, names: Iterable[str]) -> list[str]:
        """The elementwise state keys the parameters ``names`` have (all the same)."""
        keys: list[str] = []
        for name in names:
            for key in self.moments.get(name, {}):
                if key not in keys:
                    keys.append(key)
        return keys


def zero_optimizer_of(engine: Any) -> ZeroOptimizer | Stage3Optimizer:
    """ds's ZeRO optimizer of either engine (the pipeline engine keeps it as ``zero``)."""
    for candidate in (getattr(engine, "zero", None), getattr(engine, "optimizer", None)):
        if isinstance(candidate, (ZeroOptimizer, Stage3Optimizer)):
            return candidate
    raise DeepSpeedCheckpointError(
        "writing DeepSpeed's layout needs ds's ZeRO optimizer (an optimizer from the config or "
        f"one ds-zero wraps), not {type(getattr(engine, 'optimizer', None)).__name__}"
    )


def dp_group(engine: Any) -> Any:
    """``engine``'s data-parallel process group (the pipeline engine's is its grid's)."""
    group = getattr(engine, "dp_group", None)
    if group is None and hasattr(engine, "grid"):
        group = engine.grid.get_group("data")
    return group


def dp_rank(engine: Any) -> int:
    """This rank's place in ``engine``'s data-parallel group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(dp_group(engine))


def _gather_pieces(engine: Any, optimizer: ZeroOptimizer | Stage3Optimizer) -> list[tuple]:
    mine = [
        (
            s.name,
            tuple(s.shape),
            s.start,
            s.stop,
            {k: v.detach().float().cpu() for k, v in s.values.items()},
        )
        for s in optimizer.checkpoint_shards()
        if s.stop > s.start
    ]
    world = int(engine.dp_world_size)
    if not (dist.is_available() and dist.is_initialized()) or world == 1:
        return mine
    out: list[Any] = [None] * world
    dist.all_gather_object(out, mine, group=dp_group(engine))
    return [piece for pieces in out for piece in pieces]


def _assemble(pieces: list) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    fp32: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for name, shape, start, stop, values in pieces:
        numel = math.prod(shape)
        for key, value in values.items():
            into = fp32 if key == "param" else moments.setdefault(name, {})
            slot = name if key == "param" else key
            if slot not in into:  # made once, on its first piece
                into[slot] = torch.zeros(numel)
            into[slot][start:stop].copy_(value.reshape(-1))
    return fp32, moments


def module_weights(module: torch.nn.Module) -> OrderedDict[str, torch.Tensor]:
    """``module``'s state dict on every rank, ZeRO-3 parameters gathered one at a time."""
    state: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key, value in module.state_dict(keep_vars=True).items():
        with GatheredParameters([value]):
            state[key] = value.detach().cpu().clone()
    return state


def param_groups(
    optimizer: ZeroOptimizer | Stage3Optimizer, module: torch.nn.Module
) -> list[GroupState]:
    """The wrapped optimizer's param groups that hold trainable parameters, by member name."""
    inner = optimizer.optimizer
    named = list(module.named_parameters())
    order = {n: i for i, (n, _) in enumerate(named)}
    if isinstance(optimizer, Stage3Optimizer):
        by_id = {id(p): n for n, p in named}
        members = [[by_id[id(p)] for p in params] for params in optimizer.trainable]
    else:
        members = [[] for _ in inner.param_groups]
        for flat in optimizer.groups:
            members[flat.index] = list(flat.names)
    out = []
    for group, names in zip(inner.param_groups, members):
        if not names:
            continue
        step = group_step(inner, group)
        hyper = {k: v for k, v in group.items() if k != "params"}
        out.append(GroupState(sorted(names, key=order.__getitem__), hyper, step))
    return out


def loss_scaler_state(engine: Any) -> tuple[LossScalerState, int]:
    """DeepSpeed's loss-scaler object for ``engine``'s scaler, and its iteration count."""
    scaler = getattr(engine, "loss_scaler", None)
    steps = int(engine.global_steps)
    if scaler is None:
        return LossScalerState(cur_scale=1.0, dynamic=False), steps
    state = scaler.state_dict()
    if "cur_iter" not in state:
        return LossScalerState(cur_scale=float(state["cur_scale"]), dynamic=False), steps
    defaults = {
        "scale_factor": 2.0,
        "scale_window": 1000,
        "min_scale": 1,
        "delayed_shift": 2,
        "consecutive_hysteresis": False,
        "raise_error_at_min_scale": True,
    }
    extra = {k: getattr(scaler, k, v) for k, v in defaults.items()}
    return (
        DynamicLossScalerState(
            cur_scale=float(state["cur_scale"]),
            dynamic=True,
            cur_iter=int(state["cur_iter"]),
            last_overflow_iter=int(state["last_overflow_iter"]),
            cur_hysteresis=int(state["cur_hysteresis"]),
            dtype=torch.float16,
            **extra,
        ),
        int(state["cur_iter"]),
    )


def gather_state(engine: Any, module: torch.nn.Module) -> WriteState | None:
    """Collective over ``engine``'s data-parallel group: the state every layout is cut from, on
    data-parallel rank 0 (None elsewhere). ``module`` is the module whose weights are written."""
    optimizer = zero_optimizer_of(engine)
    pieces = _gather_pieces(engine, optimizer)
    weights = module_weights(module)
    groups = param_groups(optimizer, module)
    scaler, cur_iter = loss_scaler_state(engine)
    if dp_rank(engine) != 0:
        return None
    fp32, moments = _assemble(pieces)
    names = [n for g in groups for n in g.names]
    missing = [n for n in names if n not in fp32]
    if missing:
        raise DeepSpeedCheckpointError(f"no fp32 master gathered for parameters {missing[:8]}")
    return WriteState(
        fp32=fp32,
        moments=moments,
        shapes=OrderedDict((n, weights[n].shape if n in weights else torch.Size()) for n in names),
        groups=groups,
        scaler=scaler,
        cur_iter=cur_iter,
        clip=float(engine._config.gradient_clipping),
        module=weights,
    )


def group_step(inner: torch.optim.Optimizer, group: dict[str, Any]) -> torch.Tensor | None:
    """The ``step`` count of a param group (its first member that has one), as DeepSpeed saves
    it: a float32 CPU tensor; None before the first step."""
    for p in group["params"]:
        if "step" in inner.state.get(p, {}):
            return torch.as_tensor(inner.state[p]["step"], dtype=torch.float32).clone().cpu()
    return None
