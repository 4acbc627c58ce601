"""``deepspeed.runtime.zero.offload_config``: the ``offload_param`` / ``offload_optimizer``
section models and the ``offload_states`` kinds (ds-zero)."""

from __future__ import annotations

import enum

from ds_zero import OffloadOptimizerConfig, OffloadParamConfig, OffloadStateTypeEnum

DeepSpeedZeroOffloadParamConfig = OffloadParamConfig
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig


class OffloadDeviceEnum(str, enum.Enum):
    """The values of ``offload_param.device`` and ``offload_optimizer.device``."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


__all__ = [
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OffloadStateTypeEnum",
]
