"""``DeepSpeedDataLoader``: a DataLoader over a DistributedSampler whose position is checkpointed.

[Note: resumable loader position]
The loader counts the batches it has handed out in the current epoch. Its state is
``{"epoch", "batches"}``; after ``load_state_dict`` the next iteration starts ``batches``
micro-batches into epoch ``epoch``, with the same shuffle (the sampler's permutation depends only
on its seed and the epoch), so a resumed run sees exactly the batches an uninterrupted one would.
A completed pass moves on to the next epoch (reshuffled).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

__all__ = ["DeepSpeedDataLoader"]


class _SkippingSampler(DistributedSampler):
    """A DistributedSampler that can start an epoch part-way through."""

    start = 0

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        start, self.start = self.start, 0
        return iter(indices[start:])


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor (and every object with a ``.to``) moved to ``device``."""
    from torch.utils._pytree import tree_map

    def move(leaf: Any) -> Any:
        if torch.is_tensor(leaf) or callable(getattr(leaf, "to", None)):
            return leaf.to(device, non_blocking=True)
        return leaf

    return tree_map(move, batch)


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
        sampler: a sampler of the caller's instead of the distributed one (DeepSpeed's
            ``data_sampler``); a resumed position is then reached by skipping batches.
        pin_memory: page-lock batches for faster copies to the accelerator.
        device: move every batch there (its tensors, and objects with a ``.to`` such as a
            transformers ``BatchEncoding``), asynchronously from pinned memory; None or a CPU
            device leaves batches where the collate function put them. The engine passes its
            own device, so a training loop's ``.to(engine.device)`` is a no-op on a GPU.
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
        sampler: Sampler[Any] | None = None,
        pin_memory: bool = False,
        device: torch.device | None = None,
    ) -> None:
        self.device = device if device is not None and device.type != "cpu" else None
        self.custom_sampler = sampler is not None
        self.sampler: Any = sampler or _SkippingSampler(
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
            pin_memory=pin_memory,
            # Its own generator: starting an iteration must not draw from the global RNG,
            # or a resumed run's dropout masks would differ (see [Note: resumable loader position]).
            generator=torch.Generator().manual_seed(seed),
        )
        self.epoch = 0
        self.batches = 0  # handed out in the current epoch

    def __len__(self) -> int:
        """Micro-batches in one full epoch on this rank."""
        samples = len(self.sampler)
        if self.loader.drop_last:
            return samples // self.batch_size
        return -(-samples // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(self.epoch)
        batches: Iterator[Any] = iter(self.loader)
        if self.custom_sampler:
            batches = itertools.islice(batches, self.batches, None)
        else:
            self.sampler.start = self.batches * self.batch_size
        for batch in batches:
            self.batches += 1
            yield batch if self.device is None else to_device(batch, self.device)
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


_ROUTES = ("train", "eval", "predict")


def build_loader(
    engine: Any,
    dataset: Any,
    *,
    batch_size: int | None = None,
    route: str = "train",
    pin_memory: bool = True,
    data_sampler: Any = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    num_local_io_workers: int | None = None,
) -> DeepSpeedDataLoader:
    """DeepSpeed's ``engine.deepspeed_io``: micro-batches (default size
    ``train_micro_batch_size_per_gpu``) over the engine's data-parallel ranks, shuffled each
    epoch on the ``"train"`` route and in order on ``"eval"``/``"predict"``; ``data_sampler``
    replaces the distributed sampler; batches are pinned when the accelerator is not the CPU.
    """
    from ds_comm.accelerator import get_accelerator

    if route not in _ROUTES:
        raise ValueError(f"deepspeed_io(route={route!r}): expected one of {list(_ROUTES)}")
    if not (hasattr(dataset, "__getitem__") or isinstance(dataset, torch.utils.data.Dataset)):
        raise ValueError(
            f"deepspeed_io: {type(dataset).__name__} is not a torch Dataset (map-style)"
        )
    config = engine._config
    if route == "train" and data_sampler is None and config.data_efficiency.curriculum_metrics:
        from ds_engine._data_sampler import curriculum_loader  # imports this module

        return curriculum_loader(engine, dataset, batch_size=batch_size, collate_fn=collate_fn)
    return DeepSpeedDataLoader(
        dataset,
        batch_size=batch_size or config.train_micro_batch_size_per_gpu,
        dp_rank=engine.dp_rank,
        dp_world_size=engine.dp_world_size,
        collate_fn=collate_fn,
        seed=config.seed if config.seed is not None else 0,
        shuffle=route == "train",
        drop_last=config.dataloader_drop_last,
        num_workers=num_local_io_workers or 0,
        sampler=data_sampler,
        pin_memory=pin_memory and get_accelerator().device_name() != "cpu",
        # the pipeline engine builds its loader before its device (and moves micro-batches itself)
        device=getattr(engine, "device", None),
    )
