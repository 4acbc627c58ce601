"""``deepspeed.moe.sharded_moe``: the gate and the dispatch/combine layer (ds-moe)."""

from __future__ import annotations

from ds_moe import MOELayer, TopKGate

__all__ = ["MOELayer", "TopKGate"]
