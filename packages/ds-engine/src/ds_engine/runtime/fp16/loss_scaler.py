"""``deepspeed.runtime.fp16.loss_scaler``: ds-optim's loss scalers under DeepSpeed's names."""

from __future__ import annotations

from ds_optim import DynamicLossScaler, StaticLossScaler, has_overflow

# DeepSpeed's static scaler class.
LossScaler = StaticLossScaler

__all__ = ["DynamicLossScaler", "LossScaler", "StaticLossScaler", "has_overflow"]
