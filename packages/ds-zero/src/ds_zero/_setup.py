"""What both ZeRO layouts check and ask at construction: the step options, the data-parallel
rank and size, and each optimizer param group's trainable parameters."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

import ds_comm

__all__ = ["check_step_options", "dist_rank", "dp_rank_and_size", "trainable_groups"]

# DeepSpeed's communication_data_type names.
_COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def dp_rank_and_size(group: Any) -> tuple[int, int]:
    """This rank's index in ``group`` and its size (0 and 1 without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return 0, 1
    return ds_comm.get_rank(group), ds_comm.get_world_size(group)


def dist_rank() -> int:
    """This process's global rank (0 without a process group): names per-rank files."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def trainable_groups(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> list[list[torch.nn.Parameter]]:
    """Each optimizer group's trainable parameters, checked against the model."""
    in_model = {id(p) for p in model.parameters()}
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    missing = [
        n for n, p in model.named_parameters() if p.requires_grad and id(p) not in in_optimizer
    ]
    if missing:
        raise ValueError(
            f"trainable parameters missing from the optimizer: {missing[:5]}; pass all of "
            "model.parameters() to it, or set requires_grad=False on the ones to freeze"
        )
    if in_optimizer - in_model:
        raise ValueError("the optimizer holds parameters that are not in the model")
    groups = [[p for p in g["params"] if p.requires_grad] for g in optimizer.param_groups]
    kinds = {(p.dtype, p.device) for g in groups for p in g}
    if not kinds:
        raise ValueError("the model has no trainable parameters")
    if len(kinds) > 1:
        raise ValueError(
            f"trainable parameters must share one dtype and device, got {sorted(map(str, kinds))};"
            " cast the model first (e.g. model.to(torch.bfloat16))"
        )
    dtype = next(iter(kinds))[0]
    if not dtype.is_floating_point:
        raise ValueError(f"parameters of dtype {dtype} cannot be trained")
    return groups


def check_step_options(
    accumulation: int,
    clipping: float,
    predivide: float | None,
    communication_data_type: torch.dtype | str | None,
) -> torch.dtype | None:
    """Validate the options every ZeRO optimizer takes; return the communication dtype."""
    if predivide is not None and not (0 < predivide < math.inf):
        raise ValueError(
            f"gradient_predivide_factor = {predivide}: expected a finite number > 0 (or None: "
            "divide by the world size before the sum)"
        )
    if accumulation < 1:
        raise ValueError(f"gradient_accumulation_steps = {accumulation}: expected >= 1")
    if not clipping >= 0:
        raise ValueError(f"gradient_clipping = {clipping}: expected >= 0")
    comm_dtype = _COMM_DTYPES.get(communication_data_type, communication_data_type)  # type: ignore[arg-type]
    if comm_dtype not in (None, *_COMM_DTYPES.values()):
        raise ValueError(
            f"communication_data_type = {communication_data_type!r}: expected one of "
            f"{list(_COMM_DTYPES)}, a matching torch dtype, or None (the gradients' dtype)"
        )
    return comm_dtype  # type: ignore[return-value]
