"""``deepspeed.runtime``: DeepSpeed's runtime module paths over the ds packages.

Submodules load on first attribute access: ``zero`` (ds-zero), ``pipe`` (ds-pipe), ``engine``,
``config``, ``dataloader``, ``utils``, ``lr_schedules`` (ds-optim), ``base_optimizer``,
``fp16``, ``activation_checkpointing``, ``data_pipeline``, ``progressive_layer_drop`` and
``sequence_parallel`` (Ulysses' data adapter).
"""

from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = frozenset(
    {
        "activation_checkpointing",
        "base_optimizer",
        "config",
        "data_pipeline",
        "dataloader",
        "engine",
        "fp16",
        "lr_schedules",
        "pipe",
        "progressive_layer_drop",
        "sequence_parallel",
        "utils",
        "zero",
    }
)

__all__ = sorted(_SUBMODULES)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBMODULES})
