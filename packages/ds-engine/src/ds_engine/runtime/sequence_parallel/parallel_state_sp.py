"""``deepspeed.runtime.sequence_parallel.parallel_state_sp``: DeepSpeed's sequence-parallel mpu.

DeepSpeed's Ulysses scripts call ``initialize_sequence_parallel(N)`` and pass this module as
``deepspeed.initialize(mpu=...)``; it keeps the groups in module state, as DeepSpeed's does
(the groups of one job, like ``deepspeed.utils.groups``). Here the groups are one ds-comm
``ParallelGrid(sp=N)`` (``dp = world / N``), so the module also answers the data- and
model-parallel questions the engine asks an mpu.
"""

from __future__ import annotations

from typing import Any

from ds_comm import GridMpu, ParallelGrid

__all__ = [
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_sequence_data_parallel_group",
    "get_sequence_data_parallel_rank",
    "get_sequence_data_parallel_world_size",
    "get_sequence_parallel_group",
    "get_sequence_parallel_rank",
    "get_sequence_parallel_world_size",
    "initialize_sequence_parallel",
]

_mpu: GridMpu | None = None


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    """Build the sequence-parallel and sequence-data-parallel groups (collective).

    Raises:
        ValueError: the size is not > 1 or does not divide the world.
        RuntimeError: the groups exist already (call ``_release_sequence_parallel_groups``).
    """
    global _mpu
    if _mpu is not None:
        raise RuntimeError("sequence parallel group is already initialized")
    size = sequence_parallel_size
    if isinstance(size, bool) or not isinstance(size, int) or size <= 1:
        raise ValueError(f"sequence_parallel_size must be an integer > 1, got {size!r}")
    _mpu = ParallelGrid(sp=size).mpu()


def _release_sequence_parallel_groups() -> None:
    """Forget the groups (DeepSpeed's name), e.g. before initializing again."""
    global _mpu
    _mpu = None


def _grid() -> GridMpu:
    if _mpu is None:
        raise RuntimeError(
            "sequence parallel group is not initialized: call "
            "parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size) first"
        )
    return _mpu


def get_sequence_parallel_group() -> Any:
    """This rank's sequence-parallel group."""
    return _grid().get_sequence_parallel_group()


def get_sequence_parallel_world_size() -> int:
    """Ranks in the sequence-parallel group."""
    return _grid().get_sequence_parallel_world_size()


def get_sequence_parallel_rank() -> int:
    """This rank's index in the sequence-parallel group."""
    return _grid().get_sequence_parallel_rank()


def get_sequence_data_parallel_group() -> Any:
    """The ``sp x dp`` group ZeRO shards and reduces over."""
    return _grid().get_sequence_data_parallel_group()


def get_sequence_data_parallel_world_size() -> int:
    """Ranks in the ``sp x dp`` group."""
    return _grid().get_sequence_data_parallel_world_size()


def get_sequence_data_parallel_rank() -> int:
    """This rank's index in the ``sp x dp`` group."""
    return _grid().get_sequence_data_parallel_rank()


def get_data_parallel_group() -> Any:
    """The data-parallel group (the ranks across sequence groups); not in DeepSpeed's module."""
    return _grid().get_data_parallel_group()


def get_data_parallel_world_size() -> int:
    """Ranks in the data-parallel group; not in DeepSpeed's module."""
    return _grid().get_data_parallel_world_size()


def get_data_parallel_rank() -> int:
    """This rank's data-parallel index; not in DeepSpeed's module."""
    return _grid().get_data_parallel_rank()


def get_model_parallel_group() -> Any:
    """The (one-rank) model-parallel group; not in DeepSpeed's module."""
    return _grid().get_model_parallel_group()


def get_model_parallel_world_size() -> int:
    """1: no model parallelism; not in DeepSpeed's module."""
    return _grid().get_model_parallel_world_size()


def get_model_parallel_rank() -> int:
    """0: no model parallelism; not in DeepSpeed's module."""
    return _grid().get_model_parallel_rank()
