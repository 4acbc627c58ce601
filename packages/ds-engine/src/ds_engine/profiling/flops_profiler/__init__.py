"""``deepspeed.profiling.flops_profiler``: per-module parameters, MACs, FLOPs and forward latency
(DeepSpeed's ``FlopsProfiler`` and ``get_model_profile``), counted at the aten level so that every
operator the forward runs is seen (see docs/profiling.md)."""

from __future__ import annotations

from ds_engine.profiling.flops_profiler import profiler
from ds_engine.profiling.flops_profiler.profiler import (
    DEFAULT_PRECISION,
    FlopsProfiler,
    bytes_to_string,
    duration_to_string,
    flops_to_string,
    get_model_profile,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = [
    # the profiler
    "FlopsProfiler",
    "get_model_profile",
    "profiler",
    # number formatting (DeepSpeed's helpers)
    "DEFAULT_PRECISION",
    "bytes_to_string",
    "duration_to_string",
    "flops_to_string",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]
