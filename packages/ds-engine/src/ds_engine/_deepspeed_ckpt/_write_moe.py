"""A ds engine with MoE layers, in the layout DeepSpeed's ``_save_moe_checkpoint`` writes.

[Note: DeepSpeed's MoE checkpoint]
DeepSpeed writes, for a model with ``MoE`` layers:

- ``layer_L_expert_E_mp_rank_00_model_states.pt`` per expert: that expert's weights (model
  dtype), keys naming it by its global id ``E`` (``...deepspeed_experts.<E>.weight``), ``L``
  counting the MoE layers in ``named_modules`` order;
- ``mp_rank_00_model_states.pt``: the dense weights only, ``num_experts`` (one entry per MoE
  layer), ``ds_autoep_layers = None``, and at stage 0 ``optimizer`` = rank 0's optimizer state;
- at ZeRO stage 0, ``expp_rank_R_mp_rank_00_optim_states.pt`` per expert-parallel rank ``R``:
  ``{"optimizer": state}``, the optimizer state of a rank holding experts
  ``R * n .. R * n + n - 1`` (``n = num_experts / ep_size``): the dense group's parameters, then
  the ``ep_size_<ep>`` group of the rank's local experts (local ids ``0 .. n - 1``), in module
  order (see [Note: DeepSpeed's stage-0 optimizer state] for the per-parameter layout).

DeepSpeed's loader reads the ``expp_rank`` file of its own expert-parallel rank, so the file set
serves any data-parallel world size that is a multiple of ``ep_size``. Written here: ds runs at
ZeRO stage 0 (where each rank holds its experts' whole state) into DeepSpeed's stage 0, one
``ep_size`` for all MoE layers. Other combinations are refused naming the missing piece.
"""

from __future__ import annotations

import re
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ds_engine._deepspeed_ckpt._pickle import DeepSpeedCheckpointError, save_file
from ds_engine._deepspeed_ckpt._write_stage0 import stage0_optimizer
from ds_engine._deepspeed_ckpt._write_state import (
    GroupState,
    WriteState,
    group_step,
    loss_scaler_state,
    module_weights,
    zero_optimizer_of,
)

__all__ = ["has_moe", "write_moe"]

_EXPERTS = "deepspeed_moe.experts.deepspeed_experts."


def _moe_layers(module: torch.nn.Module) -> list[tuple[str, Any]]:
    ds_moe = sys.modules.get("ds_moe")
    if ds_moe is None:
        return []
    return [(n, m) for n, m in module.named_modules() if isinstance(m, ds_moe.MoE)]


def has_moe(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds ds-moe ``MoE`` layers."""
    return bool(_moe_layers(module))


def _prefix(layer_name: str) -> str:
    return f"{layer_name}.{_EXPERTS}" if layer_name else _EXPERTS


class _Experts:
    """Local <-> global expert names of this rank's MoE layers."""

    def __init__(self, module: torch.nn.Module) -> None:
        layers = _moe_layers(module)
        sizes = {int(layer.ep_size) for _, layer in layers}
        if len(sizes) != 1:
            raise DeepSpeedCheckpointError(
                f"MoE layers of several ep_size {sorted(sizes)}: writing DeepSpeed's layout for "
                "more than one expert-parallel size is not implemented"
            )
        self.ep_size = sizes.pop()
        self.num_experts = [int(layer.num_experts) for _, layer in layers]
        self.local = int(layers[0][1].num_local_experts)
        group = layers[0][1].expert_group
        self.ep_rank = 0 if group is None else int(group.expert_parallel_rank)
        self.edp_rank = (
            (dist.get_rank() if dist.is_available() and dist.is_initialized() else 0)
            if group is None
            else int(group.expert_data_parallel_rank)
        )
        self.prefixes = [_prefix(n) for n, _ in layers]
        self._pattern = re.compile(
            "^(" + "|".join(re.escape(p) for p in self.prefixes) + r")(\d+)\.(.+)$"
        )

    def split(self, name: str) -> tuple[str, int, str] | None:
        """``(prefix, local id, suffix)`` of an expert parameter name, None for dense ones."""
        match = self._pattern.match(name)
        return None if match is None else (match[1], int(match[2]), match[3])

    def to_global(self, name: str) -> str:
        parts = self.split(name)
        if parts is None:
            return name
        prefix, local, suffix = parts
        return f"{prefix}{self.ep_rank * self.local + local}.{suffix}"


def _local_values(optimizer: Any, module: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Every trainable parameter this rank holds: fp32 master and elementwise state, flat."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    inner = optimizer.optimizer
    for flat, master in zip(optimizer.groups, optimizer.masters):
        state = {
            k: v
            for k, v in inner.state.get(master, {}).items()
            if torch.is_tensor(v) and v.dim() == 1 and v.numel() == master.numel()
        }
        names = iter(flat.names)
        for unit in flat.units:
            for p, offset in zip(unit.params, unit.offsets):
                at, n = unit.shard_start + offset, p.numel()
                values = {"param": master[at : at + n]}
                values.update({k: v[at : at + n] for k, v in state.items()})
                out[next(names)] = {k: v.detach().float().cpu().clone() for k, v in values.items()}
    return out


def _group_templates(optimizer: Any, experts: _Experts) -> list[tuple[list[str], bool, dict, Any]]:
    """Per param group (optimizer order): member names (dense) or ``prefix``/``suffix``
    templates (experts), whether it is an expert group, hyper-parameters and ``step``."""
    inner = optimizer.optimizer
    members: list[list[str]] = [[] for _ in inner.param_groups]
    for flat in optimizer.groups:
        members[flat.index] = list(flat.names)
    out = []
    for group, names in zip(inner.param_groups, members):
        if not names:
            continue
        step = group_step(inner, group)
        split = [experts.split(n) for n in names]
        is_expert = all(s is not None for s in split)
        if is_expert:
            templates = list(dict.fromkeys((s[0], s[2]) for s in split if s is not None))
            names = [f"{prefix}\0{suffix}" for prefix, suffix in templates]
        hyper = {k: v for k, v in group.items() if k != "params"}
        out.append((names, is_expert, hyper, step))
    return out


def _rank_groups(templates: list, experts: _Experts, ep_rank: int, order: dict) -> list[tuple]:
    """The groups of DeepSpeed's expert-parallel rank ``ep_rank``: (local names, global names,
    hyper, step), members in module order."""
    out = []
    for names, is_expert, hyper, step in templates:
        if not is_expert:
            ordered = sorted(names, key=lambda n: order.get(n, 0))
            out.append((ordered, ordered, hyper, step))
            continue
        pairs = [t.split("\0") for t in names]
        local, whole = [], []
        for prefix in experts.prefixes:
            for i in range(experts.local):
                for p, suffix in pairs:
                    if p == prefix:
                        local.append(f"{prefix}{i}.{suffix}")
                        whole.append(f"{prefix}{ep_rank * experts.local + i}.{suffix}")
        ordered = sorted(zip(local, whole), key=lambda pair: order.get(pair[0], 0))
        out.append(([a for a, _ in ordered], [b for _, b in ordered], hyper, step))
    return out


def write_moe(engine: Any, root: Path, *, world: int, stage: int, client: dict[str, Any]) -> None:
    """Write the MoE layout (see [Note: DeepSpeed's MoE checkpoint]); collective over all
    ranks."""
    from ds_engine._deepspeed_ckpt._write import engine_meta, low_precision, model_states

    if stage != 0 or int(engine._config.zero_optimization.stage) != 0:
        raise DeepSpeedCheckpointError(
            "writing DeepSpeed's MoE layout is implemented from and for ZeRO stage 0 (run ds at "
            f"zero_optimization.stage 0 and pass stage=0), not stage {stage} from ds stage "
            f"{engine._config.zero_optimization.stage}"
        )
    optimizer = zero_optimizer_of(engine)
    experts = _Experts(engine.module)
    if world % experts.ep_size:
        raise DeepSpeedCheckpointError(
            f"world_size={world} is not a multiple of the MoE layers' ep_size={experts.ep_size}"
        )
    weights = module_weights(engine.module)
    values = _local_values(optimizer, engine.module)
    dense_writer = dist.get_rank() == 0 if dist.is_available() and dist.is_initialized() else True
    mine = {
        experts.to_global(n): (v, weights.get(n))
        for n, v in values.items()
        if (experts.split(n) is not None and experts.edp_rank == 0) or dense_writer
    }
    mine_weights = {  # expert buffers too
        experts.to_global(k): v
        for k, v in weights.items()
        if experts.split(k) is not None and experts.edp_rank == 0
    }
    templates = _group_templates(optimizer, experts)
    scaler, cur_iter = loss_scaler_state(engine)
    gathered: list[Any] = [(mine, mine_weights)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (mine, mine_weights))
    if not dense_writer:
        return
    whole: dict[str, Any] = {}
    expert_weights: dict[str, torch.Tensor] = {}
    for part, part_weights in gathered:
        whole.update(part)
        expert_weights.update(part_weights)
    order = {n: i for i, (n, _) in enumerate(engine.module.named_parameters())}
    dtype = low_precision(engine)
    root.mkdir(parents=True, exist_ok=True)
    rank0_optimizer = None
    for ep_rank in range(experts.ep_size):
        groups, fp32, moments, shapes = [], {}, {}, OrderedDict()
        for local, global_names, hyper, step in _rank_groups(templates, experts, ep_rank, order):
            for ln, gn in zip(local, global_names):
                if gn not in whole:
                    raise DeepSpeedCheckpointError(f"no optimizer state gathered for {gn!r}")
                vals, weight = whole[gn]
                fp32[ln] = vals["param"]
                moments[ln] = {k: v for k, v in vals.items() if k != "param"}
                shapes[ln] = weight.shape if weight is not None else expert_weights[gn].shape
            groups.append(GroupState(local, hyper, step))
        rank_state = WriteState(fp32, moments, shapes, groups, scaler, cur_iter, 0.0)
        optim = stage0_optimizer(rank_state, dtype is not None)
        rank0_optimizer = optim if ep_rank == 0 else rank0_optimizer
        save_file({"optimizer": optim}, root / f"expp_rank_{ep_rank}_mp_rank_00_optim_states.pt")
    for layer_id, prefix in enumerate(experts.prefixes):
        for expert in range(experts.num_experts[layer_id]):
            own = f"{prefix}{expert}."
            state = {k: v for k, v in expert_weights.items() if k.startswith(own)}
            if not state:
                raise DeepSpeedCheckpointError(f"no weights gathered for expert {own!r}")
            save_file(state, root / f"layer_{layer_id}_expert_{expert}_mp_rank_00_model_states.pt")
    dense = OrderedDict((k, v) for k, v in weights.items() if experts.split(k) is None)
    empty = WriteState({}, {}, OrderedDict(), [], scaler, cur_iter, 0.0)
    states = model_states(
        engine_meta(engine),
        empty,
        module=dense,
        optimizer=rank0_optimizer,
        world=world,
        stage=0,
        client_state={},
    )
    states["num_experts"] = list(experts.num_experts)
    states["ds_autoep_layers"] = None
    states.update(client)
    save_file(states, root / "mp_rank_00_model_states.pt")
