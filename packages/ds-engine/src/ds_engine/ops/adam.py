"""``deepspeed.ops.adam``: ds-optim's Adam implementations under DeepSpeed's names."""

from __future__ import annotations

from ds_optim import CPUAdam, FusedAdam

DeepSpeedCPUAdam = CPUAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
