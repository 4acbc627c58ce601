"""``deepspeed.runtime.pipe.module``: ``PipelineModule`` and its layer specs (ds-pipe)."""

from __future__ import annotations

from ds_comm import PipeDataParallelTopology, PipeModelDataParallelTopology
from ds_engine._optional import require

_pipe = require("ds_pipe", "ds-pipe", "deepspeed.runtime.pipe.module")

PipelineModule = _pipe.PipelineModule
LayerSpec = _pipe.LayerSpec
TiedLayerSpec = _pipe.TiedLayerSpec
partition_uniform = _pipe.partition_uniform
partition_balanced = _pipe.partition_balanced

__all__ = [
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineModule",
    "TiedLayerSpec",
    "partition_balanced",
    "partition_uniform",
]
