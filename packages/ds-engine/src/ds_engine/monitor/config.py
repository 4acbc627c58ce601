"""``deepspeed.monitor.config``: the monitor config models, the ones ds's config parses.

``TensorBoardConfig(enabled=True, output_path="runs")`` and friends take DeepSpeed's keywords;
``get_monitor_config(param_dict)`` reads the four sections of a config dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ds_engine._config_monitor import (
    CometConfig,
    CsvMonitorConfig,
    MonitorConfig,
    TensorBoardConfig,
    WandbConfig,
)

CSVConfig = CsvMonitorConfig


def _section(cls: Any, value: Any) -> Any:
    return value if isinstance(value, cls) else cls.from_dict(value or {})


def DeepSpeedMonitorConfig(
    tensorboard: Any = None, wandb: Any = None, csv_monitor: Any = None, comet: Any = None
) -> MonitorConfig:
    """The four sections (dicts or config objects) as one monitor config."""
    return MonitorConfig(
        _section(TensorBoardConfig, tensorboard),
        _section(WandbConfig, wandb),
        _section(CsvMonitorConfig, csv_monitor),
        _section(CometConfig, comet),
    )


def get_monitor_config(param_dict: Mapping[str, Any]) -> MonitorConfig:
    """The monitor config of a DeepSpeed config dict (absent sections: disabled)."""
    return DeepSpeedMonitorConfig(
        **{key: param_dict.get(key) for key in ("tensorboard", "wandb", "csv_monitor", "comet")}
    )


__all__ = [
    "CSVConfig",
    "CometConfig",
    "DeepSpeedMonitorConfig",
    "TensorBoardConfig",
    "WandbConfig",
    "get_monitor_config",
]
