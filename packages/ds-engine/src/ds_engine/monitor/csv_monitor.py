"""``deepspeed.monitor.csv_monitor``: ``csvMonitor`` (not implemented in ds)."""

from __future__ import annotations

from ds_engine._not_implemented import not_implemented

csvMonitor = not_implemented("deepspeed.monitor.csv_monitor.csvMonitor", "the CSV monitor")

__all__ = ["csvMonitor"]
