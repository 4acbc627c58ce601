"""Public types of ds-comm: errors, the ``comms_logger`` config section, the reduce op enum, and
the config-validation helpers every package's config section uses (ds-comm is the layer they all
share), so an unknown key reads the same wherever it is found."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
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
    # config validation
    "as_section",
    "check_keys",
    "closest",
    "is_auto",
    "without_auto",
]


class ConfigError(ValueError):
    """A config section has an unknown key or a bad value; the message names key, value and fix."""


def is_auto(value: Any) -> bool:
    """True for ``"auto"``, the placeholder Hugging Face clients write before resolving a key."""
    return isinstance(value, str) and value == "auto"


def without_auto(section: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``section`` without its ``"auto"`` values: DeepSpeed's config models treat
    ``"auto"`` as unset, so the key takes its default."""
    return {k: v for k, v in section.items() if not is_auto(v)}


def as_section(where: str, section: Any) -> dict[str, Any]:
    """A copy of a JSON section (``None``: empty); anything but a mapping is a ConfigError.

    Example:
        >>> as_section("aio", None)
        {}
    """
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise ConfigError(f"{where} = {section!r}: expected a JSON object")
    return dict(section)


def closest(name: str, candidates: Iterable[str], *, cutoff: float = 0.6) -> str | None:
    """The candidate most like ``name`` (difflib's similarity at least ``cutoff``), or None."""
    close = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=cutoff)
    return close[0] if close else None


def check_keys(
    where: str,
    section: Iterable[Any],
    known: Iterable[str],
    *,
    what: str = "a known key",
    listing: str = "known keys",
    always_list: bool = False,
) -> None:
    """Raise ConfigError for the first key of ``section`` that is not in ``known``.

    The message names the key's full path and the fix: the closest known key, or every known key
    when none is close.

    Args:
        where: the section's config path (``"zero_optimization"``); ``""`` for the top level.
        section: the section (a mapping: its keys are checked) or the keys themselves.
        known: the keys the section takes.
        what: what a good key is, for the message (``"a parameter of WarmupLR"``).
        listing: the name of the known keys in the message when none is close.
        always_list: list the known keys even after a close match (short lists).

    Example:
        >>> check_keys("aio", {"queue_dept": 8}, ["queue_depth", "block_size"])
        Traceback (most recent call last):
        ...
        ds_comm.api.ConfigError: aio.queue_dept is not a known key; did you mean 'queue_depth'?
    """
    accepted = sorted(set(known))
    for key in section:
        if key in accepted:
            continue
        path = f"{where}.{key}" if where else str(key)
        close = closest(str(key), accepted)
        hint = f"did you mean {close!r}?" if close else ""
        if always_list or not close:
            hint = f"{hint} {listing}: {', '.join(accepted)}".lstrip()
        raise ConfigError(f"{path} is not {what}; {hint}")


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
        section = without_auto(as_section("comms_logger", section))
        check_keys("comms_logger", section, (f.name for f in fields(cls)))
        return cls(**section)
