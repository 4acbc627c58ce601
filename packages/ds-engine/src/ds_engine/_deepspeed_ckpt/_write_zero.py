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
from dataclasses import dataclass
from typing import Any

import torch

from ds_engine._deepspeed_ckpt._pickle import (
    DynamicLossScalerState,
    FragmentAddress,
    ZeroStage,
)
from ds_engine._deepspeed_ckpt._write_state import GroupState, WriteState

__all__ = ["PartGroup", "stage12_file", "stage12_files", "stage3_files"]

_ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor (stages 1-2)


def _step(group: GroupState) -> dict[str, torch.Tensor]:
    return {} if group.step is None else {"step": group.step.clone()}


def _header(state: WriteState) -> dict[str, Any]:
    return {
        "loss_scaler": state.scaler,
        "dynamic_loss_scale": isinstance(state.scaler, DynamicLossScalerState),
        "overflow": False,
    }


@dataclass
class PartGroup:
    """One param group as one rank's ZeRO-1/2 file holds it.

    Attributes:
        labels: the members' names in the file (``param_slice_mappings``), in flat order.
        fp32: each member's whole fp32 master, flat (same order).
        moments: each elementwise state key's whole tensors per member (same order).
        hyper: the group's hyper-parameters.
        step: the group's ``step`` (None before the first step).
        parts: the ranks the group is partitioned over (its partition count).
        index: this rank's partition.
    """

    labels: list[str]
    fp32: list[torch.Tensor]
    moments: dict[str, list[torch.Tensor]]
    hyper: dict[str, Any]
    step: torch.Tensor | None
    parts: int
    index: int


def _slice(group: PartGroup) -> tuple[dict, torch.Tensor, int, OrderedDict]:
    """``(optimizer state entry, fp32 slice, padding, slice mapping)`` of ``group``'s partition
    (see [Note: DeepSpeed's ZeRO partitions])."""
    total = sum(t.numel() for t in group.fp32)
    unit = _ALIGNMENT * group.parts
    padded = math.ceil(total / unit) * unit
    part = padded // group.parts
    low, high = group.index * part, (group.index + 1) * part
    padding = padded - total if group.index == group.parts - 1 else 0

    def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
        whole = torch.cat([t.reshape(-1) for t in tensors])
        return torch.nn.functional.pad(whole, (0, padded - whole.numel()))[low:high].clone()

    mapping: OrderedDict[str, FragmentAddress] = OrderedDict()
    at = 0
    for label, tensor in zip(group.labels, group.fp32):
        lo, hi = max(low, at), min(high, at + tensor.numel())
        if lo < hi:
            mapping[label] = FragmentAddress(numel=hi - lo, start=lo - low)
        at += tensor.numel()
    step = {} if group.step is None else {"step": group.step.clone()}
    entry = {**step, **{k: flat(v) for k, v in group.moments.items()}}
    return entry, flat(group.fp32)[: part - padding], padding, mapping


def stage12_file(state: WriteState, groups: list[PartGroup], stage: int, version: str) -> dict:
    """One rank's ``optimizer_state_dict`` of DeepSpeed's stage 1/2 optimizer; ``state`` gives
    the loss scaler and clipping."""
    slices = [_slice(g) for g in groups]
    return {
        **_header(state),
        **({} if state.clip is None else {"clip_grad": state.clip}),
        "base_optimizer_state": {
            "state": {i: s[0] for i, s in enumerate(slices) if s[0]},
            "param_groups": [{**g.hyper, "params": [i]} for i, g in enumerate(groups)],
        },
        "single_partition_of_fp32_groups": [s[1] for s in slices],
        "zero_stage": ZeroStage(stage),
        "group_paddings": [s[2] for s in slices],
        "param_alignment_paddings": [[0] * len(g.labels) for g in groups],
        "partition_count": [g.parts for g in groups],
        "ds_version": version,
        "param_slice_mappings": [s[3] for s in slices],
    }


def stage12_files(state: WriteState, world: int, stage: int, version: str) -> list[dict]:
    """Rank ``r``'s ``optimizer_state_dict`` of DeepSpeed's stage 1/2 optimizer, for each ``r``
    (see [Note: DeepSpeed's ZeRO partitions])."""
    files = []
    for r in range(world):
        groups = [
            PartGroup(
                labels=list(g.names),
                fp32=[state.fp32[n] for n in g.names],
                moments={
                    k: [state.moments[n][k] for n in g.names] for k in state.state_keys(g.names)
                },
                hyper=g.hyper,
                step=g.step,
                parts=world,
                index=r,
            )
            for g in state.groups
        ]
        files.append(stage12_file(state, groups, stage, version))
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
