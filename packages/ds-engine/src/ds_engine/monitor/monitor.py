"""``deepspeed.monitor.monitor``: the ``Monitor`` base and ``MonitorMaster``.

Each DeepSpeed monitor class takes its config section and writes on global rank 0 only; the
writing itself is ds-engine's sinks (``ds_engine._monitor``), the same ones the engine uses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import ds_comm
from ds_engine._monitor import Event, EventSink, require_package

__all__ = ["Monitor", "MonitorMaster"]


def _global_rank() -> int:
    return ds_comm.get_rank() if ds_comm.is_initialized() else 0


class Monitor:
    """One monitor: ``write_events([(tag, value, step), ...])`` on rank 0 when enabled.

    Subclasses pass their section, the package the backend needs (None: none) and how to build
    the sink; the sink exists only on rank 0 of an enabled monitor.
    """

    def __init__(
        self,
        monitor_config: Any,
        package: str | None = None,
        make_sink: Callable[[Any], EventSink] | None = None,
    ) -> None:
        self.monitor_config = monitor_config
        self.enabled = bool(getattr(monitor_config, "enabled", False))
        self.sink: EventSink | None = None
        if self.enabled and package is not None:
            require_package(package)
        if self.enabled and make_sink is not None and _global_rank() == 0:
            self.sink = make_sink(monitor_config)

    def write_events(self, event_list: Sequence[Event]) -> None:
        """Write ``(tag, value, step)`` events (rank 0 of an enabled monitor only)."""
        if self.sink is not None:
            self.sink.write_events(event_list)


class MonitorMaster(Monitor):
    """Every enabled monitor of a ``DeepSpeedMonitorConfig``, written to together."""

    def __init__(self, monitor_config: Any) -> None:
        from ds_engine.monitor.comet import CometMonitor
        from ds_engine.monitor.csv_monitor import csvMonitor
        from ds_engine.monitor.tensorboard import TensorBoardMonitor
        from ds_engine.monitor.wandb import WandbMonitor

        super().__init__(monitor_config)
        self.tb_monitor = TensorBoardMonitor(monitor_config.tensorboard)
        self.wandb_monitor = WandbMonitor(monitor_config.wandb)
        self.csv_monitor = csvMonitor(monitor_config.csv_monitor)
        self.comet_monitor = CometMonitor(monitor_config.comet)
        self.enabled = monitor_config.enabled

    def write_events(self, event_list: Sequence[Event]) -> None:
        for monitor in (self.tb_monitor, self.wandb_monitor, self.csv_monitor, self.comet_monitor):
            monitor.write_events(event_list)
