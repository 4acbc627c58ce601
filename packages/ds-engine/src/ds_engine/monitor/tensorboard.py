"""``deepspeed.monitor.tensorboard``: ``TensorBoardMonitor`` (``torch.utils.tensorboard``)."""

from __future__ import annotations

from typing import Any

from ds_engine._monitor import TensorBoardSink
from ds_engine.monitor.monitor import Monitor

__all__ = ["TensorBoardMonitor"]


class TensorBoardMonitor(Monitor):
    """Scalars into ``<output_path>/<job_name>`` on rank 0; ``summary_writer`` is torch's writer."""

    def __init__(self, tensorboard_config: Any) -> None:
        super().__init__(
            tensorboard_config,
            "tensorboard",
            lambda c: TensorBoardSink(c.output_path, c.job_name),
        )
        self.output_path = tensorboard_config.output_path
        self.job_name = tensorboard_config.job_name
        self.summary_writer = getattr(self.sink, "summary_writer", None)

    def flush(self) -> None:
        """Flush the event file (rank 0 of an enabled monitor)."""
        if self.summary_writer is not None:
            self.summary_writer.flush()
