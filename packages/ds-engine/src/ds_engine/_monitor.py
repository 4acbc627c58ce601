"""``engine.monitor``: DeepSpeed's ``MonitorMaster``, writing ``(tag, value, step)`` events.

The engine writes ``Train/Samples/train_loss``, ``Train/Samples/lr`` and (fp16)
``Train/Samples/loss_scale`` at every optimizer step, keyed by samples seen, as DeepSpeed does;
user code may write its own. Only global rank 0 writes, to every enabled backend of the config's
``tensorboard``, ``wandb``, ``csv_monitor`` and ``comet`` sections, through the real libraries.
With no section enabled the monitor is disabled and writes nowhere, as in DeepSpeed.

Better than DeepSpeed: a backend whose package is missing is a start-up error on every rank
(naming the section and the pip command), not a failure on rank 0 alone that leaves the other
ranks waiting; and every sink is closed (flushed) by ``engine.destroy()``.
"""

from __future__ import annotations

import csv
import importlib.util
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from ds_comm.api import ConfigError

__all__ = [
    "CometSink",
    "CsvSink",
    "EventSink",
    "Monitor",
    "TensorBoardSink",
    "WandbSink",
    "build_monitor",
    "require_package",
]

Event = tuple[str, Any, int]


class EventSink(Protocol):
    """One destination of monitor events (a CSV folder, a TensorBoard run)."""

    def write_events(self, events: Sequence[Event]) -> None: ...


class CsvSink:
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


class TensorBoardSink:
    """``tensorboard``: scalars through ``torch.utils.tensorboard.SummaryWriter`` into
    ``<output_path>/<job_name>``, flushed after every batch of events (as DeepSpeed does)."""

    def __init__(self, output_path: str, job_name: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = os.path.join(output_path, job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self.summary_writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, events: Sequence[Event]) -> None:
        for tag, value, step in events:
            self.summary_writer.add_scalar(tag, _scalar(value), step)
        self.summary_writer.flush()

    def close(self) -> None:
        self.summary_writer.close()


class WandbSink:
    """``wandb``: one ``wandb.init(project=, group=, entity=team)`` run, ``wandb.log`` per event."""

    def __init__(self, project: str, group: str | None, team: str | None) -> None:
        import wandb  # pyright: ignore[reportMissingImports]  (optional extra)

        self._wandb = wandb
        self.run = wandb.init(project=project, group=group, entity=team)

    def write_events(self, events: Sequence[Event]) -> None:
        for tag, value, step in events:
            self.log({tag: _scalar(value)}, step=step)

    def log(
        self, data: dict[str, Any], step: int | None = None, commit: bool | None = None
    ) -> None:
        """``wandb.log`` into this run."""
        self._wandb.log(data, step=step, commit=commit)

    def close(self) -> None:
        self.run.finish()


class CometSink:
    """``comet``: a ``comet_ml.start(...)`` experiment; an event is logged when it is new or
    ``samples_log_interval`` samples have passed since that tag was last logged."""

    def __init__(self, section: Any) -> None:
        import comet_ml  # pyright: ignore[reportMissingImports]  (optional; only with comet on)

        self.experiment = comet_ml.start(
            api_key=section.api_key,
            project=section.project,
            workspace=section.workspace,
            experiment_key=section.experiment_key,
            mode=section.mode,
            online=section.online,
        )
        if section.experiment_name is not None:
            self.experiment.set_name(section.experiment_name)
        self.samples_log_interval = section.samples_log_interval
        self._last_logged: dict[str, int] = {}

    def write_events(self, events: Sequence[Event]) -> None:
        for tag, value, step in events:
            last = self._last_logged.get(tag)
            if last is not None and step - last < self.samples_log_interval:
                continue
            self._last_logged[tag] = step
            self.experiment.log_metric(tag, _scalar(value), step=step)

    def close(self) -> None:
        self.experiment.end()


# config section -> the module its backend needs (csv_monitor needs none)
MODULE_OF_SECTION = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}
_SECTION_OF = {module: section for section, module in MODULE_OF_SECTION.items()}


def require_package(module: str) -> None:
    """Raise a ``ConfigError`` naming the section and the pip command when ``module`` is missing."""
    if importlib.util.find_spec(module) is None:
        section = _SECTION_OF.get(module, module)
        raise ConfigError(
            f"{section}.enabled = true needs the {module!r} package, which is not installed: "
            f"pip install {module} (or pip install 'ds-engine[monitor]'), or set "
            f"{section}.enabled to false"
        )


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

    def close(self) -> None:
        """Flush and close every sink (``engine.destroy()`` calls it); later writes go nowhere."""
        for sink in self.sinks:
            close = getattr(sink, "close", None)
            if close is not None:
                close()
        self.sinks = []


def build_monitor(config: Any, *, rank: int) -> Monitor:
    """The monitor of the config's enabled ``tensorboard``/``wandb``/``csv_monitor``/``comet``
    sections: the sinks on global rank 0, placeholders elsewhere (so ``enabled`` agrees on every
    rank). A missing package is a ``ConfigError`` on every rank before anything is written."""
    makers = {
        "tensorboard": lambda s: TensorBoardSink(s.output_path, s.job_name),
        "wandb": lambda s: WandbSink(s.project, s.group, s.team),
        "csv_monitor": lambda s: CsvSink(s.output_path, s.job_name),
        "comet": CometSink,
    }
    enabled = {
        name: section
        for name in makers
        if (section := getattr(config, name, None)) is not None and section.enabled
    }
    for name in enabled:  # every package first: a refusal leaves no half-made sink behind
        if name in MODULE_OF_SECTION:
            require_package(MODULE_OF_SECTION[name])
    sinks = [makers[name](s) if rank == 0 else _Remote() for name, s in enabled.items()]
    return Monitor(sinks, rank=rank)


class _Remote:
    """A configured sink seen from a rank other than 0: enabled, writes nothing there."""

    def write_events(self, events: Sequence[Event]) -> None:
        del events
