"""Public types of ds-comm: errors, the ``comms_logger`` config section, and the reduce op enum."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from torch.distributed import ReduceOp

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommsLoggerConfig",
    "ConfigError",
    "DeviceGuardError",
    "DistributedEnvError",
    "ReduceOp",
]


class ConfigError(ValueError):
    """A config section has an unknown key or a bad value; the message names key, value and fix."""


class DistributedEnvError(RuntimeError):
    """The launch environment is incomplete or inconsistent (e.g. RANK set but WORLD_SIZE missing)."""


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete in time; the message says which rank is where."""


class CollectiveMismatchError(RuntimeError):
    """Ranks entered different collectives at the same sequence number (debug mode)."""


class DeviceGuardError(RuntimeError):
    """A collective got a tensor on a device its group cannot use (device guard mode)."""


@dataclass(frozen=True, kw_only=True)
class CommsLoggerConfig:
    """The ``comms_logger`` config section (DeepSpeed's names and defaults).

    Attributes:
        enabled: record every collective (size, latency, algorithm, bandwidth).
        verbose: print one line per recorded collective as it completes.
        prof_all: record all ops; when False only ops named in ``prof_ops`` are recorded.
        prof_ops: op names to record when ``prof_all`` is False, e.g. ``["all_reduce"]``.
        debug: check op fingerprints across ranks at every collective (slow; for small runs).
    """

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    prof_ops: tuple[str, ...] = field(default_factory=tuple)
    debug: bool = False

    def __post_init__(self) -> None:
        for name in ("enabled", "verbose", "prof_all", "debug"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ConfigError(
                    f"comms_logger.{name} = {value!r}: expected true or false "
                    f"(got {type(value).__name__})"
                )
        if isinstance(self.prof_ops, str) or not all(isinstance(op, str) for op in self.prof_ops):
            raise ConfigError(
                f"comms_logger.prof_ops = {self.prof_ops!r}: expected a list of op names "
                'such as ["all_reduce", "all_gather"]'
            )
        object.__setattr__(self, "prof_ops", tuple(self.prof_ops))

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> CommsLoggerConfig:
        """Build from the JSON ``comms_logger`` section; unknown keys are errors with a suggestion.
        ``"auto"`` (Hugging Face's placeholder) is a key's default, as in DeepSpeed's models."""
        section = {
            k: v for k, v in (section or {}).items() if not (isinstance(v, str) and v == "auto")
        }
        known = {f.name for f in fields(cls)}
        for key in section:
            if key not in known:
                import difflib

                close = difflib.get_close_matches(key, sorted(known), n=1)
                hint = (
                    f"; did you mean {close[0]!r}?" if close else f"; known keys: {sorted(known)}"
                )
                raise ConfigError(f"comms_logger.{key} is not a known key{hint}")
        return cls(**section)
