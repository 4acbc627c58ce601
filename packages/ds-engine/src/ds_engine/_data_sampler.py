"""The data-efficiency curriculum sampler and the training loader that uses it.

[Note: the single-cluster curriculum sampler]
DeepSpeed's ``DeepSpeedDataSampler`` draws one *global* batch (micro-batch x data-parallel size
x accumulation steps) at a time. Before each draw it advances its ``curriculum_step`` and asks
every metric's :class:`CurriculumScheduler` for the difficulty at that step
(``current_difficulties``); the loader hands ``(batch, sampler.state_dict())`` to the client's
post-process function, which applies the difficulty (``seqlen_truncate`` cuts the sequences to
it). For ``single_cluster`` metrics the pool is every sample: one permutation, read in order
and reshuffled when used up, and each global batch shuffled again; every rank takes its
contiguous share of each micro-batch slice.

DeepSpeed computes the permutation on rank 0, writes it as an index file under
``data_cluster_path`` and broadcasts every batch. Here every rank draws the same permutation from
a generator seeded with ``data_efficiency.seed`` (the same on all ranks), so no files and no
collective are needed; the generator's state is part of the sampler's state, so a resumed run
draws what an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import default_collate

from ds_engine._curriculum import CurriculumScheduler
from ds_engine._loader import DeepSpeedDataLoader

__all__ = ["CurriculumDataLoader", "DeepSpeedDataSampler", "curriculum_loader"]


class DeepSpeedDataSampler:
    """Global batches of sample indices under a curriculum (see [Note: the single-cluster
    curriculum sampler]); iterating yields this rank's index list per micro-batch.

    Args:
        metrics: metric name -> schedule config (``min_difficulty``, ``schedule_type``, ...).
        one_epoch_total_samples: the dataset's length.
        num_epochs: passes over the data before iteration stops.
        micro_batch_size, data_parallel_rank, data_parallel_size, gradient_accumulation_steps:
            the batch geometry.
        seed: the shuffle seed (the same on every rank).
        drop_last: drop a last incomplete micro-batch.
    """

    def __init__(
        self,
        metrics: Mapping[str, Mapping[str, Any]],
        *,
        one_epoch_total_samples: int,
        num_epochs: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        gradient_accumulation_steps: int,
        seed: int,
        drop_last: bool = True,
    ) -> None:
        if one_epoch_total_samples <= 0:
            raise ValueError("the curriculum sampler needs a non-empty dataset")
        self.curriculum_schedulers = {name: CurriculumScheduler(m) for name, m in metrics.items()}
        self.one_epoch_total_samples = one_epoch_total_samples
        self.total_samples = one_epoch_total_samples * num_epochs
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.global_batch_size = (
            self.micro_batch_times_data_parallel_size * gradient_accumulation_steps
        )
        self.drop_last = drop_last
        self.generator = torch.Generator().manual_seed(seed)
        self.batch: list[int] = []
        self.consumed_samples = 0
        self.curriculum_step = 0
        self.current_difficulties: dict[str, Any] = {}
        self._pool = self._shuffled(torch.arange(one_epoch_total_samples))
        self._position = 0

    def __len__(self) -> int:
        """Samples over all epochs and ranks (DeepSpeed's length)."""
        return self.total_samples

    def set_custom_curriculum_learning_schedule(
        self, schedule_func_dict: Mapping[str, Callable[[int], Any]]
    ) -> None:
        """Give metrics with the ``custom`` schedule their ``step -> difficulty`` functions."""
        unknown = sorted(set(schedule_func_dict) - set(self.curriculum_schedulers))
        if unknown:
            raise KeyError(
                f"set_custom_curriculum_learning_schedule: no curriculum metric named {unknown}; "
                f"the config's metrics are {sorted(self.curriculum_schedulers)}"
            )
        for name, function in schedule_func_dict.items():
            self.curriculum_schedulers[name].set_custom_get_difficulty(function)

    def _shuffled(self, indices: torch.Tensor) -> torch.Tensor:
        return indices[torch.randperm(len(indices), generator=self.generator)]

    def get_next_global_batch(self) -> None:
        """Advance the curriculum one step and draw the next global batch."""
        self.curriculum_step += 1
        for name, scheduler in self.curriculum_schedulers.items():
            self.current_difficulties[name] = scheduler.update_difficulty(self.curriculum_step)
        taken: list[torch.Tensor] = []
        wanted = self.global_batch_size
        while wanted > 0:
            if self._position >= len(self._pool):
                self._pool = self._shuffled(self._pool)
                self._position = 0
            chunk = self._pool[self._position : self._position + wanted]
            self._position += len(chunk)
            wanted -= len(chunk)
            taken.append(chunk)
        self.batch = self._shuffled(torch.cat(taken)).tolist()

    def _rank_slice(self, length: int) -> tuple[int, int]:
        start = round(self.data_parallel_rank * length / self.data_parallel_size)
        end = round((self.data_parallel_rank + 1) * length / self.data_parallel_size)
        return start, end

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_times_data_parallel_size
        while self.consumed_samples <= self.total_samples:
            if not self.batch:
                self.get_next_global_batch()
            current, self.batch = self.batch[:step], self.batch[step:]
            if len(current) == step or (current and not self.drop_last):
                start, end = self._rank_slice(len(current))
                self.consumed_samples += len(current)
                yield current[start:end]

    def progress(self) -> dict[str, Any]:
        """DeepSpeed's state keys a post-process function reads (``current_difficulties``,
        ``curriculum_step``, ...), without the permutation."""
        return {
            "batch": list(self.batch),
            "consumed_samples": self.consumed_samples,
            "curriculum_step": self.curriculum_step,
            "current_difficulties": dict(self.current_difficulties),
        }

    def state_dict(self) -> dict[str, Any]:
        """The position, curriculum step, current difficulties and shuffle state (DeepSpeed's
        keys, plus the permutation in use)."""
        return {
            **self.progress(),
            "curriculum_schedulers": {
                name: s.state_dict() for name, s in self.curriculum_schedulers.items()
            },
            "data_cluster_current_position": [self._position],
            "pool": self._pool.clone(),
            "rng_state": self.generator.get_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a :meth:`state_dict`."""
        self.batch = list(state["batch"])
        self.consumed_samples = int(state["consumed_samples"])
        self.curriculum_step = int(state["curriculum_step"])
        self.current_difficulties = dict(state["current_difficulties"])
        for name, saved in state["curriculum_schedulers"].items():
            self.curriculum_schedulers[name].load_state_dict(saved)
        self._position = int(state["data_cluster_current_position"][0])
        self._pool = torch.as_tensor(state["pool"]).clone()
        self.generator.set_state(state["rng_state"])


class CurriculumDataLoader(DeepSpeedDataLoader):
    """The training loader when the data-efficiency curriculum is on: micro-batches drawn by a
    :class:`DeepSpeedDataSampler`, passed through ``post_process_func(batch,
    sampler.progress())`` when the client set one (``engine.set_data_post_process_func``).

    Its position is the sampler's state (``state_dict``), saved with engine checkpoints.
    """

    def __init__(
        self,
        dataset: Any,
        sampler: DeepSpeedDataSampler,
        *,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        # Not DeepSpeedDataLoader's torch DataLoader: batches come from the sampler directly.
        self.dataset = dataset
        self.data_sampler = self.sampler = sampler
        self.batch_size = sampler.micro_batch_size
        self.collate_fn = collate_fn or default_collate
        self.post_process_func: Callable[[Any, dict[str, Any]], Any] | None = None
        self.custom_sampler = True
        self.epoch = 0
        self.batches = 0

    def __len__(self) -> int:
        """Micro-batches this rank gets over all of the sampler's epochs."""
        return (
            self.data_sampler.total_samples
            // self.data_sampler.micro_batch_times_data_parallel_size
        )

    def __iter__(self) -> Iterator[Any]:
        for indices in self.data_sampler:
            data = self.collate_fn([self.dataset[i] for i in indices])
            if self.post_process_func is not None:
                data = self.post_process_func(data, self.data_sampler.progress())
            self.batches += 1
            yield data

    def state_dict(self) -> dict[str, Any]:  # pyright: ignore[reportIncompatibleMethodOverride]
        """The sampler's state."""
        return {"data_sampler": self.data_sampler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume the sampler."""
        self.data_sampler.load_state_dict(state["data_sampler"])


def curriculum_loader(
    engine: Any,
    dataset: Any,
    *,
    batch_size: int | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> CurriculumDataLoader:
    """The engine's training loader under ``data_efficiency``'s curriculum (DeepSpeed's
    ``deepspeed_io`` with ``curriculum_learning_enabled()``)."""
    config = engine._config
    efficiency = config.data_efficiency
    sampler = DeepSpeedDataSampler(
        efficiency.curriculum_metrics,
        one_epoch_total_samples=len(dataset),
        num_epochs=efficiency.data_sampling["num_epochs"],
        micro_batch_size=batch_size or config.train_micro_batch_size_per_gpu,
        data_parallel_rank=engine.dp_rank,
        data_parallel_size=engine.dp_world_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        seed=efficiency.seed,
        drop_last=True,
    )
    return CurriculumDataLoader(dataset, sampler, collate_fn=collate_fn)
