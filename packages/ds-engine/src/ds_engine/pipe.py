"""``deepspeed.pipe``: PipelineModule, LayerSpec, TiedLayerSpec and the pipeline engine and
topologies from ds-pipe and ds-comm."""

from __future__ import annotations

import importlib
from typing import Any

from ds_engine._optional import require

_NAMES = ("PipelineModule", "LayerSpec", "TiedLayerSpec")
# DeepSpeed's deepspeed.pipe also exports these; present once ds-pipe has PipelineModule.
_MORE = {
    "PipelineEngine": "ds_pipe",
    "ProcessTopology": "ds_comm",
    "PipeDataParallelTopology": "ds_comm",
    "PipeModelDataParallelTopology": "ds_comm",
}
_pipe = require("ds_pipe", "ds-pipe", "deepspeed.pipe (ds_engine.pipe)")
if not all(hasattr(_pipe, name) for name in _NAMES):
    raise ImportError(
        "deepspeed.pipe (ds_engine.pipe): the installed ds-pipe does not provide PipelineModule "
        "yet (pipeline parallelism has not landed); install a ds-pipe release that does: "
        "pip install -U ds-pipe"
    )


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(_pipe, name)
    if name in _MORE:
        return getattr(importlib.import_module(_MORE[name]), name)
    raise AttributeError(f"module 'ds_engine.pipe' has no attribute {name!r}")


__all__ = [*_NAMES, *_MORE]
