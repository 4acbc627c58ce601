"""``deepspeed.monitor.tensorboard``: ``TensorBoardMonitor`` (not implemented in ds)."""

from __future__ import annotations

from ds_engine._not_implemented import not_implemented

TensorBoardMonitor = not_implemented(
    "deepspeed.monitor.tensorboard.TensorBoardMonitor", "the TensorBoard monitor"
)

__all__ = ["TensorBoardMonitor"]
