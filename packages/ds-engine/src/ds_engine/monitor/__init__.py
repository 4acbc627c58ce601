"""``deepspeed.monitor``: DeepSpeed's training monitors (TensorBoard, Weights & Biases, CSV,
Comet) and their config models.

ds does not implement these monitors yet: every class of DeepSpeed's ``monitor.monitor``,
``monitor.tensorboard``, ``monitor.wandb``, ``monitor.csv_monitor``, ``monitor.comet`` and
``monitor.config`` imports (client modules import them at their top) and raises
``NotImplementedError`` naming the monitor when it is built. The config sections
(``tensorboard``, ``wandb``, ``csv_monitor``, ``comet``) are ds-engine's config's to refuse.
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
