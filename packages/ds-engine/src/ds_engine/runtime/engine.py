"""``deepspeed.runtime.engine``: ``DeepSpeedEngine`` and the callable types ``initialize`` takes."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.optim.lr_scheduler import LRScheduler

from ds_engine._engine import DeepSpeedEngine

# ``initialize(optimizer=..., lr_scheduler=...)`` also takes factories of these shapes.
DeepSpeedOptimizerCallable = Callable[
    [Iterable[torch.nn.Parameter] | Iterable[dict]], torch.optim.Optimizer
]
DeepSpeedSchedulerCallable = Callable[[torch.optim.Optimizer], LRScheduler]

__all__ = ["DeepSpeedEngine", "DeepSpeedOptimizerCallable", "DeepSpeedSchedulerCallable"]
