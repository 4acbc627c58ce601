"""DeepSpeed's ZeRO optimizer files (``[bf16_]zero_pp_rank_R_mp_rank_XX_optim_states.pt``),
stages 1-3, any number of param groups, cut from a :class:`WriteState` for a target world size.

[Note: DeepSpeed's ZeRO partitions]
Stages 1 and 2 flatten each param group (members in order), pad the flat tensor to a multiple of
``2 * world`` elements (DeepSpeed's ``nccl_start_alignment_factor``) and give rank ``r`` the
``r``-th equal slice. Each rank's file holds its slice of the fp32 master per group (the padding
stripped from the last rank, ``group_paddings``), the wrapped optimizer's ``state_dict()`` with
one flat tensor per group (state id = group index, padding kept), and where each parameter falls
in the slice (``param_slice_mappings``). BF16_Optimizer (DeepSpeed's bf16 wrapper at stage 1
with fp32 gradient accumulation, and for bf16 pipelines) reads a subset of the same keys.

Stage 3 partitions each parameter on its own: ``ceil(numel / world)`` elements per rank, the last
padded. A rank's fp32 sub-group is its slices of the group's members, concatenated; DeepSpeed
keeps one sub-group per param group while the group's partition is under ``sub_group_size``
(1e9 elements by default), which is the layout written here.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import torch

from ds_engine._deepspeed_ckpt._pickle import (
    DynamicLossScalerState,
    FragmentAddress,
    ZeroStage,
)
from ds_engine._deepspeed_ckpt._write_state import GroupState, WriteState

__all__ = ["stage12_files", "stage3_files"]

_ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor (stages 1-2)


def _flat(values: dict[str, torch.Tensor], names: list[str], padded: int) -> torch.Tensor:
    whole = torch.cat([values[n].reshape(-1) for n in names])
    return torch.nn.functional.pad(whole, (0, padded - whole.numel()))


def _step(group: GroupState) -> dict[str, torch.Tensor]:
    return {} if group.step is None else {"step": group.step.clone()}


def _header(state: WriteState) -> dict[str, Any]:
    return {
        "loss_scaler": state.scaler,
        "dynamic_loss_scale": isinstance(state.scaler, DynamicLossScalerState),
        "overflow": False,
    }


def stage12_files(state: WriteState, world: int, stage: int, version: str) -> list[dict]:
    """Rank ``r``'s ``optimizer_state_dict`` of DeepSpeed's stage 1/2 optimizer, for each ``r``
    (see [Note: DeepSpeed's ZeRO partitions])."""
    per_rank: list[dict[str, list]] = [
        {"state": [], "fp32": [], "paddings": [], "mappings": [], "align": []} for _ in range(world)
    ]
    for g in state.groups:
        total = sum(state.fp32[n].numel() for n in g.names)
        padded = math.ceil(total / (_ALIGNMENT * world)) * _ALIGNMENT * world
        part = padded // world
        master = _flat(state.fp32, g.names, padded)
        moments = {
            key: _flat({n: state.moments[n][key] for n in g.names}, g.names, padded)
            for key in state.state_keys(g.names)
        }
        offsets, at = {}, 0
        for n in g.names:
            offsets[n] = (at, at + state.fp32[n].numel())
            at += state.fp32[n].numel()
        for r in range(world):
            low, high = r * part, (r + 1) * part
            padding = padded - total if r == world - 1 else 0
            mapping = OrderedDict()
            for n, (begin, end) in offsets.items():
                lo, hi = max(low, begin), min(high, end)
                if lo < hi:
                    mapping[n] = FragmentAddress(numel=hi - lo, start=lo - low)
            mine = per_rank[r]
            mine["state"].append(
                {**_step(g), **{k: v[low:high].clone() for k, v in moments.items()}}
            )
            mine["fp32"].append(master[low : high - padding].clone())
            mine["paddings"].append(padding)
            mine["mappings"].append(mapping)
            mine["align"].append([0] * len(g.names))
    files = []
    for mine in per_rank:
        files.append(
            {
                **_header(state),
                **({} if state.clip is None else {"clip_grad": state.clip}),
                "base_optimizer_state": {
                    "state": {i: s for i, s in enumerate(mine["state"]) if s},
                    "param_groups": [
                        {**g.hyper, "params": [i]} for i, g in enumerate(state.groups)
                    ],
                },
                "single_partition_of_fp32_groups": mine["fp32"],
                "zero_stage": ZeroStage(stage),
                "group_paddings": mine["paddings"],
                "param_alignment_paddings": mine["align"],
                "partition_count": [world] * len(state.groups),
                "ds_version": version,
                "param_slice_mappings": mine["mappings"],
            }
        )
    return files


def _split(values: dict[str, torch.Tensor], names: list[str], world: int) -> list[torch.Tensor]:
    """Each rank's stage-3 sub-group: its slice of every member, concatenated."""
    parts: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for n in names:
        flat = values[n].reshape(-1)
        size = math.ceil(flat.numel() / world)
        padded = torch.nn.functional.pad(flat, (0, size * world - flat.numel()))
        for r in range(world):
            parts[r].append(padded[r * size : (r + 1) * size])
    return [torch.cat(p) for p in parts]


def stage3_files(state: WriteState, world: int) -> list[dict]:
    """Rank ``r``'s ``optimizer_state_dict`` of DeepSpeed's stage 3 optimizer, for each ``r``
    (see [Note: DeepSpeed's ZeRO partitions])."""
    masters = [_split(state.fp32, g.names, world) for g in state.groups]
    moments = [
        {
            key: _split({n: state.moments[n][key] for n in g.names}, g.names, world)
            for key in state.state_keys(g.names)
        }
        for g in state.groups
    ]
    files = []
    for r in range(world):
        optim_state = {}
        for i, g in enumerate(state.groups):
            entry = {**_step(g), **{k: v[r] for k, v in moments[i].items()}}
            if entry:
                optim_state[i] = entry
        files.append(
            {
                "zero_stage": ZeroStage.weights,
                **_header(state),
                "partition_count": world,
                "optimizer_state_dict": {
                    "state": optim_state,
                    "param_groups": [
                        {**g.hyper, "params": [i]} for i, g in enumerate(state.groups)
                    ],
                },
                "fp32_flat_groups": [m[r] for m in masters],
            }
        )
    return files
