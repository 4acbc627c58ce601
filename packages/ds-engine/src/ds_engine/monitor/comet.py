"""``deepspeed.monitor.comet``: ``CometMonitor`` (not implemented in ds)."""

from __future__ import annotations

from ds_engine._not_implemented import not_implemented

CometMonitor = not_implemented("deepspeed.monitor.comet.CometMonitor", "the Comet monitor")

__all__ = ["CometMonitor"]
