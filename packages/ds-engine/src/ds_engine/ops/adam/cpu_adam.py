"""``deepspeed.ops.adam.cpu_adam``: ``DeepSpeedCPUAdam`` is ds-optim's ``CPUAdam`` (ds-native's C
kernel; ZeRO-Offload's optimizer)."""

from __future__ import annotations

from ds_optim import CPUAdam

DeepSpeedCPUAdam = CPUAdam

__all__ = ["DeepSpeedCPUAdam"]
