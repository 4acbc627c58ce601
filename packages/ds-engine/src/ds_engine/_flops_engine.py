"""The engine's ``flops_profiler``: profile one optimizer step's forward on global rank 0 and
print (or write) DeepSpeed's report when that step completes.

As in DeepSpeed, the forward of every micro-batch of step ``profile_step`` (counted as
``engine.global_steps`` before it, from 0) starts a fresh profile, so the report shows the last
micro-batch's forward; its ``fwd``/``bwd``/``step`` latencies come from the engine's timers
under ``wall_clock_breakdown`` (the whole step), from the module hooks otherwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ds_engine._flops_config import FlopsProfilerConfig

if TYPE_CHECKING:  # imported when enabled: ``import deepspeed`` keeps ``profiling`` lazy
    from ds_engine.profiling.flops_profiler import FlopsProfiler

__all__ = ["EngineFlopsProfile"]


class EngineFlopsProfile:
    """The ``flops_profiler`` section applied to one engine.

    Attributes:
        profiler: the :class:`FlopsProfiler` (None when the section is disabled), DeepSpeed's
            ``engine.flops_profiler``.
    """

    def __init__(self, engine: Any, config: FlopsProfilerConfig) -> None:
        self.config = config
        self.rank = engine.global_rank
        self.profiler: FlopsProfiler | None = None
        if config.enabled:
            from ds_engine.profiling.flops_profiler import FlopsProfiler

            self.profiler = FlopsProfiler(engine.module, engine, config.recompute_fwd_factor)

    def due(self, global_steps: int) -> bool:
        """Whether the step after ``global_steps`` completed ones is profiled on this rank."""
        return (
            self.profiler is not None
            and self.rank == 0
            and global_steps == self.config.profile_step
        )

    @contextlib.contextmanager
    def forward(self, global_steps: int) -> Iterator[None]:
        """Profile the forward inside when the step is due."""
        if not self.due(global_steps):
            yield
            return
        assert self.profiler is not None
        self.profiler.start_profile()
        try:
            yield
        finally:
            self.profiler.stop_profile()

    def step_done(self, global_steps_before: int, global_steps: int) -> None:
        """At an optimizer step's end: print the report if that step was profiled."""
        if not self.due(global_steps_before) or self.profiler is None:
            return
        if self.profiler.started:
            config = self.config
            self.profiler.print_model_profile(
                profile_step=global_steps,
                module_depth=config.module_depth,
                top_modules=config.top_modules,
                detailed=config.detailed,
                output_file=config.output_file,
            )
        self.profiler.end_profile()
