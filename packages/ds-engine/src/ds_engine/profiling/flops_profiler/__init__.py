"""``deepspeed.profiling.flops_profiler``: DeepSpeed's FLOPS profiler, not implemented in ds.

The names import (client modules import them at their top) and raise ``NotImplementedError``
when called. The ``flops_profiler`` config section is handled by ds-engine's config (refused
when enabled). Per-step timings and communication volumes are available through the
``wall_clock_breakdown`` and ``comms_logger`` sections.
"""

from __future__ import annotations

from ds_engine._not_implemented import not_implemented

_FEATURE = "the FLOPS profiler"

FlopsProfiler = not_implemented("deepspeed.profiling.flops_profiler.FlopsProfiler", _FEATURE)
get_model_profile = not_implemented(
    "deepspeed.profiling.flops_profiler.get_model_profile", _FEATURE
)

__all__ = ["FlopsProfiler", "get_model_profile"]
