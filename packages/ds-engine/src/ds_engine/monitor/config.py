"""``deepspeed.monitor.config``: the monitor config models (not implemented in ds; the config
sections themselves are ds-engine's config's to refuse)."""

from __future__ import annotations

from ds_engine._not_implemented import not_implemented

_FEATURE = "training monitors (monitor config models)"

DeepSpeedMonitorConfig = not_implemented(
    "deepspeed.monitor.config.DeepSpeedMonitorConfig", _FEATURE
)
TensorBoardConfig = not_implemented("deepspeed.monitor.config.TensorBoardConfig", _FEATURE)
WandbConfig = not_implemented("deepspeed.monitor.config.WandbConfig", _FEATURE)
CSVConfig = not_implemented("deepspeed.monitor.config.CSVConfig", _FEATURE)
CometConfig = not_implemented("deepspeed.monitor.config.CometConfig", _FEATURE)
get_monitor_config = not_implemented("deepspeed.monitor.config.get_monitor_config", _FEATURE)

__all__ = [
    "CSVConfig",
    "CometConfig",
    "DeepSpeedMonitorConfig",
    "TensorBoardConfig",
    "WandbConfig",
    "get_monitor_config",
]
