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
``data_types.buffer_dtype`` casts buffers too; ``data_types.keep_in_fp32_modules`` names
buffers kept in (or brought back to) fp32 whatever the other settings say (``"auto"``: a
Hugging Face model's own ``_keep_in_fp32_modules_strict`` lists, e.g. an MoE router's
``e_score_correction_bias``), as in DeepSpeed 0.19. Parameters always follow the training dtype.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ds_comm import ConfigError
from ds_comm.accelerator import get_accelerator

__all__ = [
    "cast_mixed_precision",
    "cast_module_mixed_precision",
    "config_as_dict",
    "engine_device",
    "keep_in_fp32_pattern",
    "move_module",
]


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


def _castable(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def keep_in_fp32_pattern(
    module: nn.Module, setting: str | Sequence[str], dtype: torch.dtype | None
) -> re.Pattern[str] | None:
    """The names of the buffers to keep in fp32 under fp16/bf16 (``data_types.
    keep_in_fp32_modules``): ``"auto"`` takes each submodule's Hugging Face lists
    (``_keep_in_fp32_modules_strict``, and under fp16 ``_keep_in_fp32_modules``), scoped to that
    submodule; a list is patterns where ``*`` is any characters, found anywhere in a buffer's
    full name. None: nothing to keep (fp32 training, or no names)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    patterns: set[str] = set()
    if isinstance(setting, str):  # "auto"
        for prefix, sub in module.named_modules():
            names = set(getattr(sub, "_keep_in_fp32_modules_strict", None) or ())
            if dtype == torch.float16:
                names |= set(getattr(sub, "_keep_in_fp32_modules", None) or ())
            for name in names:
                glob = name.replace("*", ".*")
                patterns.add(rf"^{re.escape(prefix)}\..*{glob}" if prefix else glob)
    else:
        patterns = {name.replace("*", ".*") for name in setting}
    return re.compile("|".join(sorted(patterns))) if patterns else None


def cast_module_mixed_precision(
    module: nn.Module,
    param_dtype: torch.dtype | None,
    *,
    buffer_dtype: torch.dtype | None = None,
    keep_in_fp32: re.Pattern[str] | None = None,
) -> None:
    """Cast ``module``'s floating-point parameters to ``param_dtype`` and, only when
    ``buffer_dtype`` is set, its buffers to that; buffers matching ``keep_in_fp32`` are made
    (and stay) fp32 (see [Note: where the engine puts the model]).

    ZeRO-3 parameters partitioned by ``zero.Init`` were cast when they were built; one in
    another dtype is an error naming it.
    """
    if param_dtype is None:
        return
    wrong = []
    with torch.no_grad():
        for name, p in module.named_parameters():
            if not _castable(p) or p.dtype == param_dtype:
                continue
            if hasattr(p, "ds_id"):
                wrong.append(f"{name} ({p.dtype})")
            else:
                p.data = p.data.to(param_dtype)
        for prefix, owner in module.named_modules():
            for name, buffer in owner.named_buffers(recurse=False):
                if buffer is None or not _castable(buffer):
                    continue
                full = f"{prefix}.{name}" if prefix else name
                if keep_in_fp32 is not None and keep_in_fp32.search(full):
                    target = torch.float32
                elif buffer_dtype is not None:
                    target = buffer_dtype
                else:
                    continue
                if buffer.dtype != target:
                    buffer.data = buffer.data.to(target)
    if wrong:
        raise ConfigError(
            f"training in {param_dtype} but zero.Init partitioned these parameters in another "
            f"dtype: {', '.join(wrong[:5])}; pass the DeepSpeed config (config_dict_or_path=) or "
            "dtype= to zero.Init"
        )


def cast_mixed_precision(module: nn.Module, config: Any) -> None:
    """The config's mixed precision on ``module``: fp16/bf16 parameters, ``data_types``'
    ``buffer_dtype`` and ``keep_in_fp32_modules`` for buffers."""
    param_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.param_dtype_name)
    data_types = config.data_types
    cast_module_mixed_precision(
        module,
        param_dtype,
        buffer_dtype=data_types.buffer_torch_dtype if param_dtype is not None else None,
        keep_in_fp32=keep_in_fp32_pattern(module, data_types.keep_in_fp32_modules, param_dtype),
    )


def config_as_dict(config: Any) -> dict[str, Any]:
    """The parsed config as plain nested dicts (``engine.config`` when no raw dict is given)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return dataclasses.asdict(config)
    model: Any = config  # a pydantic model (DeepSpeed's own config objects)
    return dict(model.model_dump())
