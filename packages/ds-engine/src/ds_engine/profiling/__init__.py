"""``deepspeed.profiling``: ``profiling.flops_profiler`` (not implemented in ds: its names are
importable and refuse use with a clear error)."""

from __future__ import annotations

from ds_engine.profiling import flops_profiler

__all__ = ["flops_profiler"]
