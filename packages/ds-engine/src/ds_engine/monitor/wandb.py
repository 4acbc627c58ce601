"""``deepspeed.monitor.wandb``: ``WandbMonitor`` (not implemented in ds)."""

from __future__ import annotations

from ds_engine._not_implemented import not_implemented

WandbMonitor = not_implemented(
    "deepspeed.monitor.wandb.WandbMonitor", "the Weights & Biases monitor"
)

__all__ = ["WandbMonitor"]
