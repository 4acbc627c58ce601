"""``deepspeed.monitor.comet``: ``CometMonitor`` (a ``comet_ml`` experiment)."""

from __future__ import annotations

from typing import Any

from ds_engine._monitor import CometSink
from ds_engine.monitor.monitor import Monitor

__all__ = ["CometMonitor"]


class CometMonitor(Monitor):
    """A ``comet_ml.start(...)`` experiment on rank 0; each tag at most once per
    ``samples_log_interval`` samples."""

    def __init__(self, comet_config: Any) -> None:
        super().__init__(comet_config, "comet_ml", CometSink)
        self.samples_log_interval = comet_config.samples_log_interval

    @property
    def experiment(self) -> Any:
        """The ``comet_ml`` experiment (None off rank 0 or when disabled)."""
        return getattr(self.sink, "experiment", None)
