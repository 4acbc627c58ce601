"""``deepspeed.pipe``: PipelineModule, LayerSpec and TiedLayerSpec from ds-pipe."""

from __future__ import annotations

from typing import Any

from ds_engine._optional import require

_NAMES = ("PipelineModule", "LayerSpec", "TiedLayerSpec")
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
    raise AttributeError(f"module 'ds_engine.pipe' has no attribute {name!r}")


__all__ = list(_NAMES)
