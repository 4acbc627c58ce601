"""``deepspeed.runtime.dataloader``: ``DeepSpeedDataLoader`` and ``RepeatingLoader``."""

from __future__ import annotations

from typing import Any

from ds_engine._loader import DeepSpeedDataLoader

__all__ = ["DeepSpeedDataLoader", "RepeatingLoader"]  # noqa: F822  (module __getattr__)


def __getattr__(name: str) -> Any:
    # RepeatingLoader lives with the other utilities (``deepspeed.utils``).
    if name == "RepeatingLoader":
        from ds_engine.utils import RepeatingLoader

        return RepeatingLoader
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
