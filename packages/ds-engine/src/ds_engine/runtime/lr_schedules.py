"""``deepspeed.runtime.lr_schedules``: ds-optim's LR schedules under DeepSpeed's module path."""

from __future__ import annotations

from ds_optim import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_lr_scheduler,
)

__all__ = [
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_lr_scheduler",
]
