"""``deepspeed.runtime.fp16``: fp16 loss scaling (``fp16.loss_scaler``) from ds-optim."""

from __future__ import annotations

from ds_engine.runtime.fp16 import loss_scaler

__all__ = ["loss_scaler"]
