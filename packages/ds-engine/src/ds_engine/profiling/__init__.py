"""``deepspeed.profiling``: ``profiling.flops_profiler``, the FLOPs profiler."""

from __future__ import annotations

from ds_engine.profiling import flops_profiler

__all__ = ["flops_profiler"]
