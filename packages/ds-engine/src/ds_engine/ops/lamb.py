"""``deepspeed.ops.lamb``: ds-optim's LAMB under DeepSpeed's name."""

from __future__ import annotations

from ds_optim import FusedLamb

__all__ = ["FusedLamb"]
