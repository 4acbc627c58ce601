"""A ds engine with MoE layers, in the layout DeepSpeed's ``_save_moe_checkpoint`` writes.

[Note: DeepSpeed's MoE checkpoint]
DeepSpeed writes, for a model with ``MoE`` layers:

- ``layer_L_expert_E_mp_rank_00_model_states.pt`` per expert: that expert's weights (model
  dtype), keys naming it by its global id ``E`` (``...deepspeed_experts.<E>.weight``), ``L``
  counting the MoE layers in ``named_modules`` order;
- ``mp_rank_00_model_states.pt``: the dense weights only, ``num_experts`` (one entry per MoE
  layer), ``ds_autoep_layers = None``; at stage 0 ``optimizer`` = rank 0's optimizer state, at
  stages 1-2 ``param_shapes`` of rank 0's groups (its local expert names);
- at ZeRO stage 0, ``expp_rank_R_mp_rank_00_optim_states.pt`` per expert-parallel rank ``R`` of
  the largest ``ep_size``: ``{"optimizer": state}``, the optimizer state of global rank ``R``
  (see [Note: DeepSpeed's stage-0 optimizer state] for the per-parameter layout). DeepSpeed's
  loader reads the file of its rank modulo that ``ep_size``;
- at ZeRO stages 1-2, one ``zero_pp_rank_R_mp_rank_00_optim_states.pt`` per data-parallel rank
  ``R`` (see [Note: DeepSpeed's ZeRO partitions]): the dense groups partitioned over all ranks;
  each expert group (``ep_size_<E>``) holds rank ``R``'s own experts (local ids, module order)
  and is partitioned over the expert-data-parallel group of ``W / E`` ranks (``R % E``,
  ``R % E + E``, ...), ``R`` holding partition ``R // E``.

Rank ``R`` holds the experts of expert-parallel rank ``e = R % E`` under local ids
``0 .. n - 1`` (``n = num_experts / E``), whose global ids are ``e * n + local``. Each layer
keeps its own ``ep_size``; expert param groups are written in ds's optimizer order (DeepSpeed's
``split_params_into_different_moe_groups_for_optimizer`` orders several ``ep_size`` groups by
iterating a ``set``, so the resuming run must build them in the same order, see
docs/migration.md). ds runs at any ZeRO stage (stage 3's shards already name experts by global
id) are written for DeepSpeed's stages 0-2 at any data-parallel world size that every
``ep_size`` divides; DeepSpeed refuses MoE at ZeRO stage 3, and so does this writer.
"""

from __future__ import annotations

import math
import re
import sys
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ds_engine._deepspeed_ckpt._pickle import DeepSpeedCheckpointError, save_file
from ds_engine._deepspeed_ckpt._write_stage0 import stage0_optimizer
from ds_engine._deepspeed_ckpt._write_state import (
    GroupState,
    WriteState,
    dp_rank,
    group_step,
    loss_scaler_state,
    module_weights,
    zero_optimizer_of,
)
from ds_engine._deepspeed_ckpt._write_zero import PartGroup, stage12_file
from ds_zero import Stage3Optimizer

__all__ = [
    "MoELayer",
    "MoEState",
    "MoETemplate",
    "assemble_pieces",
    "check_moe_target",
    "has_moe",
    "write_moe",
    "write_moe_layout",
]

_EXPERTS = "deepspeed_moe.experts.deepspeed_experts."


def _moe_layers(module: torch.nn.Module) -> list[tuple[str, Any]]:
    ds_moe = sys.modules.get("ds_moe")
    if ds_moe is None:
        return []
    return [(n, m) for n, m in module.named_modules() if isinstance(m, ds_moe.MoE)]


def has_moe(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds ds-moe ``MoE`` layers."""
    return bool(_moe_layers(module))


@dataclass(frozen=True)
class MoELayer:
    """One MoE layer: its experts' name prefix, sizes and this rank's place."""

    prefix: str
    ep_size: int
    num_experts: int
    local: int
    ep_rank: int
    edp_rank: int


def _world_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _Experts:
    """Local <-> global expert names of this rank's MoE layers."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.layers: list[MoELayer] = []
        for name, layer in _moe_layers(module):
            group = layer.expert_group
            self.layers.append(
                MoELayer(
                    prefix=f"{name}.{_EXPERTS}" if name else _EXPERTS,
                    ep_size=int(layer.ep_size),
                    num_experts=int(layer.num_experts),
                    local=int(layer.num_local_experts),
                    ep_rank=0 if group is None else int(group.expert_parallel_rank),
                    edp_rank=_world_rank()
                    if group is None
                    else int(group.expert_data_parallel_rank),
                )
            )
        self._by_prefix = {layer.prefix: layer for layer in self.layers}
        self._pattern = re.compile(
            "^(" + "|".join(re.escape(lay.prefix) for lay in self.layers) + r")(\d+)\.(.+)$"
        )

    @property
    def max_ep_size(self) -> int:
        return max(layer.ep_size for layer in self.layers)

    def split(self, name: str) -> tuple[MoELayer, int, str] | None:
        """``(layer, local id, suffix)`` of an expert parameter name, None for dense ones."""
        match = self._pattern.match(name)
        return None if match is None else (self._by_prefix[match[1]], int(match[2]), match[3])

    def to_global(self, name: str) -> str:
        parts = self.split(name)
        if parts is None:
            return name
        layer, local, suffix = parts
        return f"{layer.prefix}{layer.ep_rank * layer.local + local}.{suffix}"


def _held_pieces(engine: Any, optimizer: Any, experts: _Experts) -> list[tuple]:
    """``(global name, numel, start, stop, values)`` of every parameter range this rank holds
    (ds's ZeRO stage 0-2 flat layout; a replicated range only from its group's rank 0)."""
    dense_rank = dp_rank(engine)
    inner = optimizer.optimizer
    out = []
    for flat, master in zip(optimizer.groups, optimizer.masters):
        state = {
            k: v
            for k, v in inner.state.get(master, {}).items()
            if torch.is_tensor(v) and v.dim() == 1 and v.numel() == master.numel()
        }
        names = iter(flat.names)
        for unit in flat.units:
            for p, offset in zip(unit.params, unit.offsets):
                name, n = next(names), p.numel()
                parts = experts.split(name)
                rank = dense_rank if parts is None else parts[0].edp_rank
                if unit.num_shards == 1:  # stage 0: the whole parameter on every rank
                    if rank != 0:
                        continue
                    begin, end, at = 0, n, unit.shard_start + offset
                else:
                    low = rank * unit.shard_numel
                    b, e = max(low, offset), min(low + unit.shard_numel, offset + n)
                    if b >= e:
                        continue
                    begin, end, at = b - offset, e - offset, unit.shard_start + b - low
                values = {"param": master, **state}
                piece = {
                    k: v[at : at + end - begin].detach().float().cpu().clone()
                    for k, v in values.items()
                }
                out.append((experts.to_global(name), n, begin, end, piece))
    return out


def assemble_pieces(pieces: Iterable[tuple]) -> dict[str, dict[str, torch.Tensor]]:
    """Whole flat fp32 tensors by name and value key, from ``(name, numel, start, stop,
    values)`` pieces; zero where no piece lands. Each tensor is made once, on its first piece."""
    whole: dict[str, dict[str, torch.Tensor]] = {}
    for name, numel, start, stop, values in pieces:
        entry = whole.setdefault(name, {})
        for key, value in values.items():
            if key not in entry:
                entry[key] = torch.zeros(numel)
            entry[key][start:stop].copy_(value)
    return whole


@dataclass
class MoETemplate:
    """One optimizer param group: dense member names, or expert ``(layer, suffix)`` pairs."""

    dense: list[str]
    experts: list[tuple[MoELayer, str]]
    hyper: dict[str, Any]
    step: torch.Tensor | None

    @property
    def ep_size(self) -> int:
        return self.experts[0][0].ep_size if self.experts else 0


def _stage3_pieces(optimizer: Stage3Optimizer) -> list[tuple]:
    """The same records from ds's ZeRO-3 optimizer, whose shards already name experts by
    global id (every element once per expert-data-parallel group)."""
    out = []
    for s in optimizer.checkpoint_shards():
        if s.stop > s.start:
            numel = math.prod(s.shape)
            values = {k: v.detach().float().cpu().clone() for k, v in s.values.items()}
            out.append((s.name, numel, s.start, s.stop, values))
    return out


def _members(optimizer: Any, module: torch.nn.Module) -> list[list[str]]:
    """Each of the wrapped optimizer's param groups' trainable members (local names)."""
    inner = optimizer.optimizer
    if isinstance(optimizer, Stage3Optimizer):
        by_id = {id(p): n for n, p in module.named_parameters()}
        return [[by_id[id(p)] for p in params] for params in optimizer.trainable]
    members: list[list[str]] = [[] for _ in inner.param_groups]
    for flat in optimizer.groups:
        members[flat.index] = list(flat.names)
    return members


def _templates(optimizer: Any, experts: _Experts, module: torch.nn.Module) -> list[MoETemplate]:
    inner = optimizer.optimizer
    members = _members(optimizer, module)
    out = []
    for group, names in zip(inner.param_groups, members):
        if not names:
            continue
        split = [experts.split(n) for n in names]
        hyper = {k: v for k, v in group.items() if k != "params"}
        step = group_step(inner, group)
        if all(s is None for s in split):
            out.append(MoETemplate(list(names), [], hyper, step))
            continue
        if any(s is None for s in split):
            raise DeepSpeedCheckpointError(
                f"param group {group.get('name')!r} mixes expert and dense parameters: DeepSpeed "
                "keeps experts in their own groups (split_params_into_different_moe_groups_"
                "for_optimizer)"
            )
        pairs = list(dict.fromkeys((s[0], s[2]) for s in split if s is not None))
        if len({layer.ep_size for layer, _ in pairs}) != 1:
            raise DeepSpeedCheckpointError(
                f"param group {group.get('name')!r} holds experts of several ep_size values: "
                "DeepSpeed keeps one group per ep_size (ep_size_<E>)"
            )
        out.append(MoETemplate([], pairs, hyper, step))
    return out


def _rank_groups(
    templates: list[MoETemplate], rank: int, order: dict[str, int]
) -> list[tuple[list[str], list[str], MoETemplate]]:
    """DeepSpeed rank ``rank``'s groups: (local names, global names, template), members in
    module order."""
    out = []
    for t in templates:
        if not t.experts:
            ordered = sorted(t.dense, key=lambda n: order.get(n, 0))
            out.append((ordered, ordered, t))
            continue
        pairs = []
        for layer, suffix in t.experts:
            e = rank % layer.ep_size
            for i in range(layer.local):
                local = f"{layer.prefix}{i}.{suffix}"
                pairs.append((local, f"{layer.prefix}{e * layer.local + i}.{suffix}"))
        pairs.sort(key=lambda pair: order.get(pair[0], 0))
        out.append(([a for a, _ in pairs], [b for _, b in pairs], t))
    return out


def check_moe_target(layers: list[MoELayer], world: int, stage: int) -> None:
    """Refuse a target DeepSpeed cannot run: ZeRO-3, or a world size some ep_size does not
    divide."""
    if stage not in (0, 1, 2):
        raise DeepSpeedCheckpointError(
            f"stage={stage}: DeepSpeed does not run MoE models at ZeRO stage 3 (its engine refuses "
            "them); write the MoE layout for stage 0, 1 or 2"
        )
    bad = sorted({lay.ep_size for lay in layers if world % lay.ep_size})
    if bad:
        raise DeepSpeedCheckpointError(
            f"world_size={world} is not a multiple of the MoE layers' ep_size {bad}: DeepSpeed "
            "needs every ep_size to divide its data-parallel world size"
        )


def _write_optimizer(
    root: Path,
    whole: dict[str, dict[str, torch.Tensor]],
    templates: list[MoETemplate],
    header: WriteState,
    *,
    order: dict[str, int],
    world: int,
    stage: int,
    dtype: str | None,
) -> Any:
    """The optimizer files; returns the model file's ``optimizer`` entry (stage 0)."""
    from ds_engine._deepspeed_ckpt._write import DEEPSPEED_VERSION

    def values(name: str) -> dict[str, torch.Tensor]:
        if name not in whole:
            raise DeepSpeedCheckpointError(f"no optimizer state gathered for {name!r}")
        return whole[name]

    if stage == 0:
        rank0 = None
        for rank in range(max((t.ep_size for t in templates), default=1) or 1):
            fp32, moments, groups = {}, {}, []
            for local, names, t in _rank_groups(templates, rank, order):
                for ln, gn in zip(local, names):
                    fp32[ln] = values(gn)["param"]
                    moments[ln] = {k: v for k, v in values(gn).items() if k != "param"}
                groups.append(GroupState(local, t.hyper, t.step))
            shapes = OrderedDict((n, header.shapes[n]) for g in groups for n in g.names)
            state = WriteState(fp32, moments, shapes, groups, header.scaler, header.cur_iter, 0.0)
            optim = stage0_optimizer(state, dtype is not None)
            rank0 = optim if rank == 0 else rank0
            save_file({"optimizer": optim}, root / f"expp_rank_{rank}_mp_rank_00_optim_states.pt")
        return rank0
    prefix = "bf16_" if dtype == "bf16" else ""
    for rank in range(world):
        parts = []
        for local, names, t in _rank_groups(templates, rank, order):
            keys = [k for k in values(names[0]) if k != "param"]
            size = t.ep_size or 1
            parts.append(
                PartGroup(
                    labels=local,
                    fp32=[values(n)["param"] for n in names],
                    moments={k: [values(n)[k] for n in names] for k in keys},
                    hyper=t.hyper,
                    step=t.step,
                    parts=world // size,
                    index=rank // size,
                )
            )
        optim = stage12_file(header, parts, stage, DEEPSPEED_VERSION)
        wrapped = {"optimizer_state_dict": optim, "ds_config": {}, "ds_version": DEEPSPEED_VERSION}
        save_file(wrapped, root / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    return None


@dataclass
class MoEState:
    """Everything the MoE layout is cut from (whole tensors, on the writing rank).

    Attributes:
        layers: the MoE layers, in ``named_modules`` order.
        templates: the optimizer's param groups (dense names or expert pairs), in order.
        whole: each trainable parameter's ``param`` (fp32 master) and elementwise state, flat,
            experts by global name.
        expert_weights: every expert's weights (model dtype) by global name.
        dense: the module's state dict without the experts.
        shapes: each trainable parameter's shape by local name.
        order: each parameter's position in the module (local names; orders a group's members).
        header: the loss scaler, its iteration count and the clipping (a :class:`WriteState`
            without tensors).
    """

    layers: list[MoELayer]
    templates: list[MoETemplate]
    whole: dict[str, dict[str, torch.Tensor]]
    expert_weights: dict[str, torch.Tensor]
    dense: OrderedDict[str, torch.Tensor]
    shapes: dict[str, torch.Size]
    order: dict[str, int]
    header: WriteState


def write_moe_layout(
    root: Path,
    state: MoEState,
    meta: dict[str, Any],
    *,
    world: int,
    stage: int,
    dtype: str | None,
    client: dict[str, Any],
) -> None:
    """Write the MoE layout of ``state`` into the tag folder ``root`` (see [Note: DeepSpeed's
    MoE checkpoint]); ``meta`` holds the model file's run-level entries."""
    from ds_engine._deepspeed_ckpt._write import model_states

    check_moe_target(state.layers, world, stage)
    rank0 = _rank_groups(state.templates, 0, state.order)
    # DeepSpeed's MoE model file records these shapes as tuples
    shapes = OrderedDict((n, tuple(state.shapes[n])) for local, _, _ in rank0 for n in local)
    groups = [GroupState(local, t.hyper, t.step) for local, _, t in rank0]
    h = state.header
    header = WriteState({}, {}, shapes, groups, h.scaler, h.cur_iter, h.clip)
    root.mkdir(parents=True, exist_ok=True)
    optim = _write_optimizer(
        root,
        state.whole,
        state.templates,
        header,
        order=state.order,
        world=world,
        stage=stage,
        dtype=dtype,
    )
    for layer_id, layer in enumerate(state.layers):
        for expert in range(layer.num_experts):
            own = f"{layer.prefix}{expert}."
            weights = {k: v for k, v in state.expert_weights.items() if k.startswith(own)}
            if not weights:
                raise DeepSpeedCheckpointError(f"no weights for expert {own!r}")
            save_file(
                weights, root / f"layer_{layer_id}_expert_{expert}_mp_rank_00_model_states.pt"
            )
    empty = WriteState({}, {}, OrderedDict(), [], h.scaler, h.cur_iter, 0.0)
    states = model_states(
        meta,
        header if stage else empty,
        module=state.dense,
        optimizer=optim,
        world=world,
        stage=stage,
        client_state={},
    )
    states["num_experts"] = [layer.num_experts for layer in state.layers]
    states["ds_autoep_layers"] = None
    states.update(client)
    save_file(states, root / "mp_rank_00_model_states.pt")


def write_moe(engine: Any, root: Path, *, world: int, stage: int, client: dict[str, Any]) -> None:
    """Write the MoE layout (see [Note: DeepSpeed's MoE checkpoint]); collective over all
    ranks."""
    from ds_engine._deepspeed_ckpt._write import engine_meta, low_precision

    optimizer = zero_optimizer_of(engine)
    experts = _Experts(engine.module)
    check_moe_target(experts.layers, world, stage)
    weights = module_weights(engine.module)
    if isinstance(optimizer, Stage3Optimizer):
        mine = _stage3_pieces(optimizer)
    else:
        mine = _held_pieces(engine, optimizer, experts)
    mine_weights = {  # each expert's weights (buffers too) from its expert-data-parallel rank 0
        experts.to_global(k): v
        for k, v in weights.items()
        if (parts := experts.split(k)) is not None and parts[0].edp_rank == 0
    }
    templates = _templates(optimizer, experts, engine.module)
    scaler, cur_iter = loss_scaler_state(engine)
    gathered: list[Any] = [(mine, mine_weights)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (mine, mine_weights))
    if _world_rank() != 0:
        return
    expert_weights: dict[str, torch.Tensor] = {}
    for _, part_weights in gathered:
        expert_weights.update(part_weights)
    clip = float(engine._config.gradient_clipping)
    state = MoEState(
        layers=experts.layers,
        templates=templates,
        whole=assemble_pieces(p for pieces, _ in gathered for p in pieces),
        expert_weights=expert_weights,
        dense=OrderedDict((k, v) for k, v in weights.items() if experts.split(k) is None),
        shapes={k: v.shape for k, v in weights.items()},
        order={n: i for i, (n, _) in enumerate(engine.module.named_parameters())},
        header=WriteState({}, {}, OrderedDict(), [], scaler, cur_iter, clip),
    )
    meta = engine_meta(engine)
    dtype = low_precision(engine)
    write_moe_layout(root, state, meta, world=world, stage=stage, dtype=dtype, client=client)
