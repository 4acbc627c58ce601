"""``deepspeed.runtime.pipe``: pipeline parallelism from ds-pipe (a dependency of
ds-engine); submodules ``module``, ``topology``, and (loaded on first use) ``engine``
and ``schedule``."""

from __future__ import annotations

import importlib
from typing import Any

from ds_engine.runtime.pipe import module, topology
from ds_engine.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from ds_engine.runtime.pipe.topology import ProcessTopology

_LAZY = frozenset({"engine", "schedule"})

__all__ = [
    "LayerSpec",
    "PipelineModule",
    "ProcessTopology",
    "TiedLayerSpec",
    "engine",
    "module",
    "schedule",
    "topology",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
