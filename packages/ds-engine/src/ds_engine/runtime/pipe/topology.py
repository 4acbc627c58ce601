"""``deepspeed.runtime.pipe.topology``: rank layouts over named axes (ds-comm) and DeepSpeed's
``PipelineParallelGrid`` over them."""

from __future__ import annotations

from ds_comm import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessGrid,
    ProcessTopology,
)
from ds_engine.runtime.pipe._grid import PipelineParallelGrid

__all__ = [
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineParallelGrid",
    "ProcessGrid",
    "ProcessTopology",
]
