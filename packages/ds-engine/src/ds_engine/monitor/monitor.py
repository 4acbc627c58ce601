"""``deepspeed.monitor.monitor``: ``MonitorMaster`` and the ``Monitor`` base (not implemented in
ds; see ``deepspeed.monitor``)."""

from __future__ import annotations

from ds_engine._not_implemented import not_implemented

MonitorMaster = not_implemented(
    "deepspeed.monitor.monitor.MonitorMaster", "training monitors (MonitorMaster)"
)
Monitor = not_implemented("deepspeed.monitor.monitor.Monitor", "training monitors (Monitor)")

__all__ = ["Monitor", "MonitorMaster"]
