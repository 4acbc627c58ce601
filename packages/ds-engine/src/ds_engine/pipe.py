"""``deepspeed.pipe``: ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``, the topologies and
the pipeline engine (ds-pipe and ds-comm, both dependencies of ds-engine).

The same objects as ``deepspeed.runtime.pipe``: ``PipelineEngine`` (loaded on first use) is the
class of what ``initialize()`` returns for a ``PipelineModule``.
"""

from __future__ import annotations

from typing import Any

from ds_engine.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from ds_engine.runtime.pipe.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

__all__ = [
    "LayerSpec",
    "PipelineModule",
    "TiedLayerSpec",
    "PipelineEngine",  # noqa: F822  (module __getattr__: loaded on first use)
    "ProcessTopology",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
]


def __getattr__(name: str) -> Any:
    if name == "PipelineEngine":
        from ds_engine.runtime.pipe.engine import PipelineEngine

        return PipelineEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
