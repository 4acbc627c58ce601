"""``deepspeed.monitor.csv_monitor``: ``csvMonitor`` (one CSV file per event tag)."""

from __future__ import annotations

from typing import Any

from ds_engine._monitor import CsvSink
from ds_engine.monitor.monitor import Monitor

__all__ = ["csvMonitor"]


class csvMonitor(Monitor):
    """``<output_path>/<job_name>/<tag>.csv`` files with a ``step,<name>`` header, on rank 0."""

    def __init__(self, csv_config: Any) -> None:
        super().__init__(csv_config, None, lambda c: CsvSink(c.output_path, c.job_name))
        self.output_path, self.job_name = csv_config.output_path, csv_config.job_name
        self.log_dir = getattr(self.sink, "log_dir", None)
