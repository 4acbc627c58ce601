"""The ``flops_profiler`` config section: DeepSpeed's keys and defaults.

With ``enabled``, global rank 0 profiles the forward of optimizer step ``profile_step`` (steps
counted from 0, as ``engine.global_steps``) and prints DeepSpeed's report, or writes it to
``output_file`` (see docs/profiling.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ds_comm.api import ConfigError
from ds_engine._config_sections import section_values

__all__ = ["FlopsProfilerConfig"]


def _int(key: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"flops_profiler.{key} = {value!r}: expected an integer >= {minimum}")


@dataclass(frozen=True, kw_only=True)
class FlopsProfilerConfig:
    """``flops_profiler``.

    Attributes:
        enabled: profile one step's forward on rank 0.
        recompute_fwd_factor: share of the forward recomputed in backward (activation
            checkpointing); the report estimates backward FLOPs as ``(2 + factor) * forward``.
        profile_step: the optimizer step (``engine.global_steps`` before it) profiled.
        module_depth: deepest level of the aggregated profile (-1: all).
        top_modules: module classes listed per depth in the aggregated profile.
        detailed: also print the model tree with each module's profile.
        output_file: write the report to this path instead of stdout (None: stdout).
    """

    enabled: bool = False
    recompute_fwd_factor: float = 0.0
    profile_step: int = 1
    module_depth: int = -1
    top_modules: int = 1
    detailed: bool = True
    output_file: str | None = None

    def __post_init__(self) -> None:
        for key in ("enabled", "detailed"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(
                    f"flops_profiler.{key} = {getattr(self, key)!r}: expected true or false"
                )
        factor = self.recompute_fwd_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 0:
            raise ConfigError(
                f"flops_profiler.recompute_fwd_factor = {factor!r}: expected a number >= 0 "
                "(0: nothing recomputed, 1: the whole forward recomputed in backward)"
            )
        _int("profile_step", self.profile_step, 0)
        _int("module_depth", self.module_depth, -1)
        _int("top_modules", self.top_modules, 1)
        if self.output_file is not None and not isinstance(self.output_file, str):
            raise ConfigError(
                f"flops_profiler.output_file = {self.output_file!r}: expected a path string or null"
            )

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> FlopsProfilerConfig:
        """Build from the JSON section (unknown keys: did-you-mean errors)."""
        return cls(**section_values("flops_profiler", section, cls))
