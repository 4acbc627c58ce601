"""``deepspeed.ops.adam``: ds-optim's Adam implementations under DeepSpeed's names
(submodules ``cpu_adam`` and ``fused_adam`` as in DeepSpeed)."""

from __future__ import annotations

from ds_engine.ops.adam.cpu_adam import DeepSpeedCPUAdam
from ds_engine.ops.adam.fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
