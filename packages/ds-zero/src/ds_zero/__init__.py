"""ZeRO stages 1-3, partitioned init, offload and reshardable checkpoints."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
