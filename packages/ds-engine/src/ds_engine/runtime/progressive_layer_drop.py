"""``deepspeed.runtime.progressive_layer_drop``: the PLD keep-ratio schedule."""

from __future__ import annotations

from ds_engine._pld import ProgressiveLayerDrop

__all__ = ["ProgressiveLayerDrop"]
