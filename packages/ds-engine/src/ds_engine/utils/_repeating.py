"""``RepeatingLoader``: iterate a loader for ever, restarting it at the end of each pass."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["RepeatingLoader"]


class RepeatingLoader:
    """Wraps an iterable (a ``DataLoader``) so that ``next`` never runs out: at the end of a
    pass it starts a new one (DeepSpeed's, used with ``engine.train_batch`` pipelines).

    Args:
        loader: the iterable to repeat.

    Example:
        >>> batches = RepeatingLoader(loader)
        >>> for step in range(10_000):
        ...     engine.train_batch(batches)
    """

    def __init__(self, loader: Iterable[Any]) -> None:
        self.loader = loader
        self.data_iter: Iterator[Any] = iter(loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            try:
                return next(self.data_iter)
            except StopIteration:
                raise ValueError(
                    "RepeatingLoader: the loader yields no batch at all (an empty dataset, or "
                    "drop_last with fewer samples than one batch); nothing to repeat"
                ) from None
