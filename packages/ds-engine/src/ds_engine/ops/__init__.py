"""``deepspeed.ops``: optimizers (``ops.adam``, ``ops.lamb``), re-exported from ds-optim."""

from __future__ import annotations

from ds_engine.ops import adam, lamb

__all__ = ["adam", "lamb"]
