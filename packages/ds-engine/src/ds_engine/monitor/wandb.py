"""``deepspeed.monitor.wandb``: ``WandbMonitor`` (one W&B run, ``wandb.log`` per event)."""

from __future__ import annotations

from typing import Any, cast

from ds_engine._monitor import WandbSink
from ds_engine.monitor.monitor import Monitor

__all__ = ["WandbMonitor"]


class WandbMonitor(Monitor):
    """``wandb.init(project=, group=, entity=team)`` on rank 0, then one ``log`` per event."""

    def __init__(self, wandb_config: Any) -> None:
        super().__init__(wandb_config, "wandb", lambda c: WandbSink(c.project, c.group, c.team))
        self.group, self.team, self.project = (
            wandb_config.group,
            wandb_config.team,
            wandb_config.project,
        )

    def log(
        self, data: dict[str, Any], step: int | None = None, commit: bool | None = None
    ) -> None:
        """``wandb.log`` on rank 0 of an enabled monitor."""
        if self.sink is not None:
            cast(WandbSink, self.sink).log(data, step=step, commit=commit)  # the sink it made
