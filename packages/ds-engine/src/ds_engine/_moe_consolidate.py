"""The whole model's weights on one rank: ZeRO-3 parameters gathered, MoE experts from every
expert-parallel rank under their global expert ids.

[Note: consolidated weights with expert parallelism]
``save_16bit_model`` and ``_zero3_consolidated_16bit_state_dict`` (accelerate's
``get_state_dict``) hand out one plain state dict of the whole model. With ``ep_size > 1`` a rank
holds only ``num_experts / ep_size`` experts, under local ids ``0 .. num_local - 1``; the whole
model is that of ``ep_size = 1``, whose expert ``e`` sits at ``...deepspeed_experts.<e>.*``. So
every entry of an expert is collected, one tensor at a time, from the ranks of global rank 0's
expert-parallel group (they hold every expert once between them; the other groups hold
replicas and send nothing), by a gather to rank 0: expert-parallel rank ``r``'s local expert
``i`` is global expert ``r * num_local + i``. Under ZeRO-3 each tensor is first gathered from
its partition (every rank takes part: experts are partitioned over their expert-data-parallel
group, dense parameters over the data-parallel group). The keys come out in the ``ep_size = 1``
model's order, so ``torch.load`` of the result loads into that model with ``strict=True``.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

import ds_comm
from ds_zero import GatheredParameters

__all__ = ["whole_state_dict"]


@dataclass(frozen=True)
class _ExpertEntry:
    """One state-dict entry of an expert this rank holds."""

    block: str  # state-dict prefix of the layer's experts, "...deepspeed_experts"
    local_id: int
    suffix: str  # the entry's key inside the expert
    num_local: int
    group: Any  # the layer's ds_moe.ExpertGroup (None: ep_size 1)

    def key(self, expert_id: int) -> str:
        return f"{self.block}.{expert_id}.{self.suffix}"


def _expert_entries(model: nn.Module) -> dict[str, _ExpertEntry]:
    """By state-dict key, every expert entry (parameters and persistent buffers) of ``model``'s
    ds-moe ``MoE`` layers."""
    ds_moe = sys.modules.get("ds_moe")
    if ds_moe is None:
        return {}
    entries: dict[str, _ExpertEntry] = {}
    for name, module in model.named_modules():
        if not isinstance(module, ds_moe.MoE):
            continue
        layer: Any = module
        experts: nn.ModuleList = layer.deepspeed_moe.experts.deepspeed_experts
        block = ".".join(p for p in (name, "deepspeed_moe.experts.deepspeed_experts") if p)
        for local, expert in enumerate(experts):
            for suffix in expert.state_dict(keep_vars=True):
                entry = _ExpertEntry(block, local, suffix, len(experts), layer.expert_group)
                entries[entry.key(local)] = entry
    return entries


def _partitioned(value: torch.Tensor) -> list[nn.Parameter]:
    """``value`` when ZeRO-3 partitions it (to gather), else nothing."""
    return [cast(nn.Parameter, value)] if hasattr(value, "ds_tensor") else []


def _gathered(value: torch.Tensor, rank: int) -> torch.Tensor | None:
    """``value`` whole (ZeRO-3: gathered; collective) on rank 0's CPU, None elsewhere."""
    with GatheredParameters(_partitioned(value)):
        return value.detach().cpu().clone() if rank == 0 else None


def _expert_copies(value: torch.Tensor, entry: _ExpertEntry, rank: int) -> dict[int, torch.Tensor]:
    """This entry of every global expert, by global id, on rank 0 (empty elsewhere); see
    [Note: consolidated weights with expert parallelism]."""
    group: Any = entry.group
    ranks = () if entry.group is None else tuple(group.expert_parallel_ranks)
    with GatheredParameters(_partitioned(value)):
        if len(ranks) <= 1:
            return {entry.local_id: value.detach().cpu().clone()} if rank == 0 else {}
        if 0 not in ranks:
            return {}  # a replica of rank 0's group's experts
        tensor = value.detach().contiguous()
        outputs = [torch.empty_like(tensor) for _ in ranks] if rank == 0 else None
        ds_comm.gather(tensor, outputs, dst=0, group=group.expert_parallel_group)
    if outputs is None:
        return {}
    order = ds_comm.get_all_ranks_from_group(group.expert_parallel_group)
    return {
        ranks.index(source) * entry.num_local + entry.local_id: out.cpu()
        for source, out in zip(order, outputs)
    }


def whole_state_dict(
    model: nn.Module, *, exclude: Collection[str] = ()
) -> OrderedDict[str, torch.Tensor]:
    """``model``'s whole state dict on global rank 0's CPU (empty on the other ranks): ZeRO-3
    parameters gathered one at a time, experts of MoE layers under their global ids from every
    expert-parallel rank (the ``ep_size = 1`` model's state dict); keys in ``exclude`` (local
    names) are left out. Every rank must call it (collective); tied weights stay one tensor
    under both names. See [Note: consolidated weights with expert parallelism].
    """
    rank = ds_comm.get_rank() if ds_comm.is_initialized() else 0
    entries = _expert_entries(model)
    state: OrderedDict[str, torch.Tensor] = OrderedDict()
    copies: dict[int, torch.Tensor | None] = {}
    blocks: dict[str, dict[int, list[tuple[str, torch.Tensor]]]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if key in exclude:
            continue
        entry = entries.get(key)
        if entry is not None:
            by_id = blocks.setdefault(entry.block, {})
            if not by_id and rank == 0:
                state[entry.block] = torch.empty(0)  # holds the block's place
            for expert_id, copy in _expert_copies(value, entry, rank).items():
                by_id.setdefault(expert_id, []).append((entry.key(expert_id), copy))
            continue
        if id(value) not in copies:
            copies[id(value)] = _gathered(value, rank)
        copy = copies[id(value)]
        if copy is not None:
            state[key] = copy
    if rank != 0:
        return OrderedDict()
    ordered: OrderedDict[str, torch.Tensor] = OrderedDict()
    for key, value in state.items():  # each layer's experts by global id, where they sat
        if key in blocks:
            for expert_id in sorted(blocks[key]):
                ordered.update(blocks[key][expert_id])
        else:
            ordered[key] = value
    return ordered
