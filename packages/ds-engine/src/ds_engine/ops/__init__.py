"""``deepspeed.ops``: optimizers (``adam``, ``lamb``, ``lion``, ``adagrad``) from ds-optim, async
I/O (``aio``) from ds-offload-aio and the op builders (``op_builder``); submodules load on first
attribute access."""

from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = frozenset({"adagrad", "adam", "aio", "lamb", "lion", "op_builder"})

__all__ = sorted(_SUBMODULES)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBMODULES})
