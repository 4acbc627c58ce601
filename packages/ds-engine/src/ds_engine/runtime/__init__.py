"""``deepspeed.runtime``: ``runtime.lr_schedules``."""

from __future__ import annotations

from ds_engine.runtime import lr_schedules

__all__ = ["lr_schedules"]
