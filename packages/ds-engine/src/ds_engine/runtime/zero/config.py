"""``deepspeed.runtime.zero.config``: the ``zero_optimization`` section model (ds-zero)."""

from __future__ import annotations

import enum

from ds_engine.runtime.zero.offload_config import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
)
from ds_zero import ZeroConfig

DeepSpeedZeroConfig = ZeroConfig


class ZeroStageEnum(enum.IntEnum):
    """DeepSpeed's names for the values of ``zero_optimization.stage``."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


__all__ = [
    "DeepSpeedZeroConfig",
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "ZeroConfig",
    "ZeroStageEnum",
]
