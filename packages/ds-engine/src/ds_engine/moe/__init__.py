"""``deepspeed.moe``: mixture of experts from ds-moe (a dependency of ds-engine);
submodules ``layer``, ``utils``, ``sharded_moe`` and ``experts`` load on first use."""

from __future__ import annotations

import importlib
from typing import Any

from ds_engine._optional import require

require("ds_moe", "ds-moe", "deepspeed.moe (ds_engine.moe)")

_SUBMODULES = frozenset({"experts", "layer", "sharded_moe", "utils"})

__all__ = sorted(_SUBMODULES)


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
