"""``deepspeed.runtime.config``: the composed DeepSpeed config (ds-engine's ``api``)."""

from __future__ import annotations

from ds_engine.api import ConfigError, DeepSpeedConfig

# DeepSpeed's name for a config error; ds raises ConfigError (a ValueError) for every bad key.
DeepSpeedConfigError = ConfigError

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError"]
