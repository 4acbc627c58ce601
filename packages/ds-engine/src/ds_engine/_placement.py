"""Where and in which dtype the engine puts the model.

[Note: where the engine puts the model]
As in DeepSpeed, the engine's device is the accelerator's: ``device_name(device_rank)`` where
the caller names a device rank (``args.device_rank``, Lightning does), else the launcher's
``LOCAL_RANK`` (``cuda:<local_rank>`` on GPUs; ``cpu`` on the CPU accelerator), made the
process's current device first. The module's whole parameters and its buffers are moved there
before the optimizer is built, so optimizer state and flat buffers are created on it. ZeRO-3
shards made by ``zero.Init`` stay where its partitioner put them (its compute device, or the
host when parameters are offloaded).

Mixed precision casts only the floating-point *parameters* to fp16/bf16; buffers keep their
dtype (fp32), as DeepSpeed does. A rotary embedding's ``inv_freq`` buffer cast to bf16 changes
the positions' angles and the loss by 1e-5 to 1e-4 relative, growing with sequence position.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from ds_comm.accelerator import get_accelerator

__all__ = ["cast_parameters", "config_as_dict", "engine_device", "move_module"]


def engine_device(device_rank: int) -> torch.device:
    """The accelerator's device of ``device_rank`` (made current), or its current device when
    ``device_rank`` is negative (no launcher)."""
    accelerator = get_accelerator()
    if device_rank >= 0:
        if accelerator.device_name() != "cpu":
            accelerator.set_device(device_rank)
        return torch.device(accelerator.device_name(device_rank))
    return torch.device(accelerator.current_device_name())


def _same_device(tensor: torch.Tensor, device: torch.device) -> bool:
    if tensor.device.type != device.type:
        return False
    return device.index is None or tensor.device.index == device.index


def move_module(module: nn.Module, device: torch.device) -> None:
    """Move ``module``'s whole parameters and buffers to ``device`` (ZeRO-3 partitioned ones
    stay with their partitioner; see [Note: where the engine puts the model])."""
    with torch.no_grad():
        for p in module.parameters():
            if hasattr(p, "ds_id") or p.device.type == "meta":
                continue
            if not _same_device(p.data, device):
                p.data = p.data.to(device)
        for owner in module.modules():
            for name, buffer in owner.named_buffers(recurse=False):
                if buffer is not None and not _same_device(buffer, device):
                    setattr(owner, name, buffer.to(device))


def cast_parameters(module: nn.Module, dtype: torch.dtype | None) -> None:
    """Cast ``module``'s floating-point parameters (not its buffers) to ``dtype`` (None: keep)."""
    if dtype is None:
        return
    with torch.no_grad():
        for p in module.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)


def config_as_dict(config: Any) -> dict[str, Any]:
    """The parsed config as plain nested dicts (``engine.config`` when no raw dict is given)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    return dict(config.model_dump())
