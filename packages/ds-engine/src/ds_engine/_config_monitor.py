"""The monitor sections of the config: ``tensorboard``, ``wandb``, ``csv_monitor`` and ``comet``.

Same keys and defaults as DeepSpeed's monitor config. An enabled section makes rank 0 write the
engine's events (``Train/Samples/train_loss``, ``lr``, ``loss_scale`` ...) to that backend; a
section whose package is missing fails at start-up on every rank, naming the key and the pip
command, instead of at the first write.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ds_comm.api import ConfigError
from ds_engine._config_sections import section_values

__all__ = ["CometConfig", "CsvMonitorConfig", "MonitorConfig", "TensorBoardConfig", "WandbConfig"]


def _check_types(where: str, section: Any, optional: tuple[str, ...] = ()) -> None:
    """``enabled`` is a bool, ``online`` a bool or null, the names in ``optional`` strings or
    null, and every other string-typed key (``output_path``, ``job_name``, ``project``) a string."""
    for f in fields(section):
        value, key = getattr(section, f.name), f"{where}.{f.name}"
        if f.name == "enabled" and not isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r}: expected true or false")
        if f.name == "online" and value is not None and not isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r}: expected true, false or null")
        if f.name in optional and value is not None and not isinstance(value, str):
            raise ConfigError(f"{key} = {value!r}: expected a string or null")
        if f.type == "str" and not isinstance(value, str):
            raise ConfigError(f"{key} = {value!r}: expected a string")


@dataclass(frozen=True, kw_only=True)
class TensorBoardConfig:
    """``tensorboard``: event files under ``<output_path>/<job_name>`` (torch's SummaryWriter)."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"

    def __post_init__(self) -> None:
        _check_types("tensorboard", self)

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> TensorBoardConfig:
        """Build from the JSON section (unknown keys: did-you-mean errors)."""
        return cls(**section_values("tensorboard", section, cls))


@dataclass(frozen=True, kw_only=True)
class CsvMonitorConfig:
    """``csv_monitor``: one CSV per event under ``<output_path>/<job_name>``."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"

    def __post_init__(self) -> None:
        _check_types("csv_monitor", self)

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> CsvMonitorConfig:
        """Build from the JSON section (unknown keys: did-you-mean errors)."""
        return cls(**section_values("csv_monitor", section, cls))


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """``wandb``: ``wandb.init(project=, group=, entity=team)`` then ``wandb.log`` per event.

    W&B's own environment (``WANDB_MODE=offline``, ``WANDB_DIR``, ``WANDB_API_KEY``) applies.
    """

    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"

    def __post_init__(self) -> None:
        _check_types("wandb", self, optional=("group", "team"))

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> WandbConfig:
        """Build from the JSON section (unknown keys: did-you-mean errors)."""
        return cls(**section_values("wandb", section, cls))


@dataclass(frozen=True, kw_only=True)
class CometConfig:
    """``comet``: a ``comet_ml.start(...)`` experiment; each event at most once per
    ``samples_log_interval`` samples, as DeepSpeed logs it."""

    enabled: bool = False
    samples_log_interval: int = 100
    project: str | None = None
    workspace: str | None = None
    api_key: str | None = None
    experiment_name: str | None = None
    experiment_key: str | None = None
    online: bool | None = None
    mode: str | None = None

    def __post_init__(self) -> None:
        optional = ("project", "workspace", "api_key", "experiment_name", "experiment_key", "mode")
        _check_types("comet", self, optional=optional)
        interval = self.samples_log_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ConfigError(
                f"comet.samples_log_interval = {interval!r}: expected a positive integer"
            )

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> CometConfig:
        """Build from the JSON section (unknown keys: did-you-mean errors)."""
        return cls(**section_values("comet", section, cls))


@dataclass(frozen=True)
class MonitorConfig:
    """DeepSpeed's ``DeepSpeedMonitorConfig``: the four sections and whether any is enabled."""

    tensorboard: TensorBoardConfig
    wandb: WandbConfig
    csv_monitor: CsvMonitorConfig
    comet: CometConfig

    @property
    def enabled(self) -> bool:
        """Whether any monitor writes."""
        return any(s.enabled for s in (self.tensorboard, self.wandb, self.csv_monitor, self.comet))
