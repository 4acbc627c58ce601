"""The ``timers`` config section: DeepSpeed's switchable throughput timer.

``timers.throughput.enabled`` turns the samples-per-second figure of rank 0's progress bar and
log line on or off; ``synchronized`` waits for the accelerator before each reading, so the figure covers the step's device work and not only the
time to queue it (it costs one synchronisation per optimizer step; on CPU there is nothing to
wait for).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ds_comm.api import ConfigError
from ds_engine._config_sections import section_values

__all__ = ["ThroughputTimerConfig", "TimersConfig"]


@dataclass(frozen=True, kw_only=True)
class ThroughputTimerConfig:
    """``timers.throughput``.

    Attributes:
        enabled: measure and report samples per second.
        synchronized: synchronise the accelerator before each reading.
    """

    enabled: bool = True
    synchronized: bool = True

    def __post_init__(self) -> None:
        for key in ("enabled", "synchronized"):
            value = getattr(self, key)
            if not isinstance(value, bool):
                raise ConfigError(f"timers.throughput.{key} = {value!r}: expected true or false")


@dataclass(frozen=True, kw_only=True)
class TimersConfig:
    """``timers``: ``{"throughput": {"enabled": true, "synchronized": true}}`` by default."""

    throughput: ThroughputTimerConfig = field(default_factory=ThroughputTimerConfig)

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> TimersConfig:
        """Build from the JSON section (unknown keys: did-you-mean errors)."""
        values = section_values("timers", section, cls)
        throughput = values.get("throughput")
        if throughput is None:
            return cls()
        return cls(
            throughput=ThroughputTimerConfig(
                **section_values("timers.throughput", throughput, ThroughputTimerConfig)
            )
        )
