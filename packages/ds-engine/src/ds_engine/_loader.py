"""``DeepSpeedDataLoader``: a DataLoader over a DistributedSampler whose position is checkpointed.

[Note: resumable loader position]
The loader counts the batches it has handed out in the current epoch. Its state is
``{"epoch", "batches"}``; after ``load_state_dict`` the next iteration starts ``batches``
micro-batches into epoch ``epoch``, with the same shuffle (the sampler's permutation depends only
on its seed and the epoch), so a resumed run sees exactly the batches an uninterrupted one would.
A completed pass moves on to the next epoch (reshuffled).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

__all__ = ["DeepSpeedDataLoader"]


class _SkippingSampler(DistributedSampler):
    """A DistributedSampler that can start an epoch part-way through."""

    start = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        start, self.start = self.start, 0
        return iter(indices[start:])


class DeepSpeedDataLoader:
    """Micro-batches of ``dataset`` for this data-parallel rank (see [Note: resumable loader
    position]).

    Args:
        dataset: a map-style dataset.
        batch_size: the micro-batch size per rank.
        dp_rank: this rank's index in the data-parallel group.
        dp_world_size: the data-parallel group's size.
        collate_fn: builds a batch from samples (torch's default when None).
        seed: the shuffle seed (the same on every rank).
        shuffle: shuffle each epoch.
        drop_last: drop the last incomplete micro-batch of each rank.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        batch_size: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        num_workers: int = 0,
    ) -> None:
        self.sampler = _SkippingSampler(
            dataset,
            num_replicas=dp_world_size,
            rank=dp_rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.batch_size = batch_size
        self.loader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=self.sampler,
            collate_fn=collate_fn,
            drop_last=drop_last,
            num_workers=num_workers,
            # Its own generator: starting an iteration must not draw from the global RNG,
            # or a resumed run's dropout masks would differ (see [Note: resumable loader position]).
            generator=torch.Generator().manual_seed(seed),
        )
        self.epoch = 0
        self.batches = 0  # handed out in the current epoch

    def __len__(self) -> int:
        """Micro-batches in one full epoch on this rank."""
        samples = self.sampler.num_samples
        if self.loader.drop_last:
            return samples // self.batch_size
        return -(-samples // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.sampler.start = self.batches * self.batch_size
        for batch in self.loader:
            self.batches += 1
            yield batch
        self.epoch += 1
        self.batches = 0

    def state_dict(self) -> dict[str, int]:
        """The loader's position: ``{"epoch", "batches"}``."""
        return {"epoch": self.epoch, "batches": self.batches}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at a saved position; the next iteration continues from there."""
        self.epoch = int(state["epoch"])
        self.batches = int(state["batches"])


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA) and Python's ``random`` (and numpy's, when it is imported)."""
    import random
    import sys

    random.seed(seed)
    torch.manual_seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed % 2**32)
