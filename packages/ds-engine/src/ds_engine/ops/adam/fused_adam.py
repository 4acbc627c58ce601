"""``deepspeed.ops.adam.fused_adam``: ds-optim's ``FusedAdam`` (ds-kernels' Triton kernel on
GPUs, multi-tensor torch elsewhere)."""

from __future__ import annotations

from ds_optim import FusedAdam

__all__ = ["FusedAdam"]
