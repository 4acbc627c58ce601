"""``engine.monitor``: DeepSpeed's ``MonitorMaster``, writing ``(tag, value, step)`` events.

The engine writes ``Train/Samples/train_loss``, ``Train/Samples/lr`` and (fp16)
``Train/Samples/loss_scale`` at every optimizer step, keyed by samples seen, as DeepSpeed does;
user code may write its own. Only global rank 0 writes. With no monitor section enabled the
monitor is disabled and writes nowhere, as in DeepSpeed.

The sink for ``csv_monitor`` is here; the config enables it once it has a typed ``csv_monitor``
section (``enabled``, ``output_path``, ``job_name``). While the config refuses the monitoring
keys as not implemented, every engine's monitor is the disabled one.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = ["CsvMonitor", "EventSink", "Monitor", "build_monitor"]

Event = tuple[str, Any, int]


class EventSink(Protocol):
    """One destination of monitor events (a CSV folder, a TensorBoard run)."""

    def write_events(self, events: Sequence[Event]) -> None: ...


class CsvMonitor:
    """``csv_monitor``: one ``<output_path>/<job_name>/<tag with / as _>.csv`` per tag, with a
    ``step,<last part of the tag>`` header, as DeepSpeed's ``csvMonitor`` writes them."""

    def __init__(self, output_path: str, job_name: str) -> None:
        self.log_dir = Path(output_path) / job_name
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._started: set[str] = set()

    def write_events(self, events: Sequence[Event]) -> None:
        for tag, value, step in events:
            name = tag.replace("/", "_").replace(" ", "_")
            path = self.log_dir / f"{name}.csv"
            with path.open("a", newline="") as handle:
                writer = csv.writer(handle)
                if name not in self._started:
                    self._started.add(name)
                    writer.writerow(["step", tag.split("/")[-1]])
                writer.writerow([step, _scalar(value)])


def _scalar(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


class Monitor:
    """Fans events out to the enabled sinks on global rank 0 (DeepSpeed's ``MonitorMaster``).

    Attributes:
        enabled: whether any sink is configured; False writes nowhere.

    Example:
        >>> if engine.monitor.enabled:
        ...     engine.monitor.write_events([("Train/eval_loss", 0.31, engine.global_samples)])
    """

    def __init__(self, sinks: Iterable[EventSink], *, rank: int) -> None:
        self.sinks = list(sinks)
        self.rank = rank
        self.enabled = bool(self.sinks)

    def write_events(self, events: Sequence[Event]) -> None:
        """Write ``(tag, value, step)`` events (only global rank 0 writes)."""
        if self.rank != 0:
            return
        for sink in self.sinks:
            sink.write_events(events)


def build_monitor(config: Any, *, rank: int) -> Monitor:
    """The monitor of the config's typed ``csv_monitor`` section when the config models have one
    and it is enabled (the sink writes on rank 0 only); otherwise the disabled monitor."""
    sinks: list[EventSink] = []
    section = getattr(config, "csv_monitor", None)  # a typed section, once the config has it
    if section is not None and section.enabled:
        sinks.append(CsvMonitor(section.output_path, section.job_name) if rank == 0 else _Remote())
    return Monitor(sinks, rank=rank)


class _Remote:
    """A configured sink seen from a rank other than 0: enabled, writes nothing there."""

    def write_events(self, events: Sequence[Event]) -> None:
        del events
