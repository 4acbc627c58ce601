"""``deepspeed.monitor``: DeepSpeed's training monitors (TensorBoard, Weights & Biases, CSV,
Comet) and their config models, with DeepSpeed's module layout (``monitor.monitor``,
``monitor.tensorboard``, ``monitor.wandb``, ``monitor.csv_monitor``, ``monitor.comet``,
``monitor.config``). The engine's ``engine.monitor`` writes through the same sinks.
"""

from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = frozenset({"comet", "config", "csv_monitor", "monitor", "tensorboard", "wandb"})

__all__ = sorted(_SUBMODULES)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
