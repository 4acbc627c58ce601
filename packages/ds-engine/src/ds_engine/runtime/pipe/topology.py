"""``deepspeed.runtime.pipe.topology``: rank layouts over named axes (ds-comm)."""

from __future__ import annotations

from ds_comm import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessGrid,
    ProcessTopology,
)

__all__ = [
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "ProcessGrid",
    "ProcessTopology",
]
