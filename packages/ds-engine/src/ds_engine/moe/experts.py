"""``deepspeed.moe.experts``: the local experts of an MoE layer (ds-moe)."""

from __future__ import annotations

from ds_moe import Experts

__all__ = ["Experts"]
