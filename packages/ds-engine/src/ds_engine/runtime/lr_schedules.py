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

# The ``scheduler.type`` names DeepSpeed builds itself (accelerate checks a config against it).
VALID_LR_SCHEDULES = [
    cls.__name__ for cls in (LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR)
]

__all__ = [
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_lr_scheduler",
    "VALID_LR_SCHEDULES",
]
