"""Ulysses sequence parallelism under the engine: the sequence axis and the groups it changes.

[Note: Ulysses under the engine]
``sequence_parallel_size = P`` (or an mpu with a sequence-parallel group, or DeepSpeed's
``mesh_param=(dp, sp)``) splits every sequence over ``P`` ranks. :func:`sequence_parallel_mpu`
builds the axis once, from ds-comm's ``ParallelGrid(sp=P)`` (``dp = world / P``), unless the
caller's mpu has one already. What the engine then does differently:

- the batch-size triad, the loaders' samplers and ``dp_world_size`` count the data-parallel
  axis only (the ``P`` ranks of a sequence group work on the same samples);
- ZeRO (every stage) shards and reduces over the *sequence-data-parallel* group (``sp x dp``,
  as DeepSpeed's engine passes ``seq_data_parallel_group``): the parameters are replicated over
  the sequence group, so sharding over it too saves ``P`` times more memory;
- the reduction averages over ``sp x dp`` ranks. Each sequence rank backpropagates the same
  global loss (:func:`ds_engine.sequence.sequence_parallel_loss`, or transformers' all-gather
  recipe), whose gradient reaches the rank's own tokens once from every sequence rank, ``P``
  times in all; the average divides that back out, so SP=P trains exactly as SP=1 does.
  (DeepSpeed divides by the data-parallel size only, which leaves a factor ``P`` in the
  gradient with that loss recipe; ds does not copy that.)
- checkpoints: model and optimizer files of replicated state are written once per
  sequence-data-parallel group, by its rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ds_comm
from ds_comm import ConfigError, ParallelGrid
from ds_comm.api import is_auto

__all__ = [
    "SequenceGroups",
    "check_sequence_composition",
    "check_sequence_parallel_size",
    "refuse_sequence_parallel_pipeline",
    "sequence_groups",
    "sequence_parallel_mpu",
]

_KEY = "sequence_parallel_size"


def check_sequence_parallel_size(value: Any) -> int:
    """``sequence_parallel_size`` as a positive integer (``"auto"`` and None: 1).

    Raises:
        ConfigError: not a positive integer.
    """
    if value is None or is_auto(value):
        return 1
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{_KEY} = {value!r}: expected a positive integer (1: no sequence split)")
    return value


def _mesh_sp(mesh_param: Any, world: int) -> int:
    """The sequence size of DeepSpeed's ``mesh_param=(data_parallel, sequence_parallel)``."""
    ok = isinstance(mesh_param, Sequence) and len(mesh_param) == 2
    ok = ok and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in mesh_param)
    if not ok:
        raise ValueError(
            f"initialize(mesh_param={mesh_param!r}): expected (data_parallel, sequence_parallel), "
            "two positive integers"
        )
    dp, sp = mesh_param
    if dp * sp != world:
        raise ValueError(
            f"initialize(mesh_param={mesh_param!r}): {dp} x {sp} = {dp * sp} ranks but the world "
            f"has {world}; choose sizes whose product is {world}"
        )
    return sp


def _mpu_sp(mpu: Any) -> int:
    if mpu is None or not hasattr(mpu, "get_sequence_parallel_world_size"):
        return 1
    return int(mpu.get_sequence_parallel_world_size())


def sequence_parallel_mpu(size: Any, mpu: Any, *, mesh_param: Any = None, tp: int = 1) -> Any:
    """The mpu the engine runs with for ``sequence_parallel_size = size`` (collective).

    Args:
        size: the config's ``sequence_parallel_size`` (as given; checked here).
        mpu: the caller's mpu (None: none). One with a sequence-parallel group of the same size
            is used as it is.
        mesh_param: DeepSpeed's ``(data_parallel, sequence_parallel)`` of ``initialize``.
        tp: the tensor-parallel size of the grid built for a split (AutoTP's ``autotp_size``).

    Returns:
        ``mpu`` itself, or ``ParallelGrid(sp=size, tp=tp).mpu()`` when a split is asked for
        and ``mpu`` is None; None stays None without a split.

    Raises:
        ConfigError: the size does not divide the world, disagrees with ``mesh_param``, or
            the given mpu has no sequence-parallel group of that size.
    """
    sp = check_sequence_parallel_size(size)
    initialized = ds_comm.is_initialized()
    world = ds_comm.get_world_size() if initialized else 1
    if mesh_param is not None:
        from_mesh = _mesh_sp(mesh_param, world)
        if sp > 1 and from_mesh != sp:
            raise ConfigError(
                f"{_KEY} = {sp} but initialize(mesh_param={tuple(mesh_param)!r}) has a sequence "
                f"size of {from_mesh}; give one of them, or the same size in both"
            )
        sp = from_mesh
    if mpu is not None:
        if sp > 1 and _mpu_sp(mpu) != sp:
            raise ConfigError(
                f"{_KEY} = {sp} but the mpu given to initialize() has a sequence-parallel group "
                f"of {_mpu_sp(mpu)} rank(s); build the mpu with the sequence axis "
                f"(ds_comm.ParallelGrid(sp={sp}, ...).mpu()) or drop {_KEY}"
            )
        return mpu
    if sp == 1:
        return None
    if world % (sp * tp):
        raise ConfigError(
            f"{_KEY} = {sp} does not divide the world size {world} (with tensor parallel size "
            f"{tp}); choose a divisor of {world // tp if world % tp == 0 else world}"
        )
    return ParallelGrid(sp=sp, tp=tp).mpu()


@dataclass(frozen=True)
class SequenceGroups:
    """The engine's sequence-parallel groups (see [Note: Ulysses under the engine]).

    Attributes:
        size: ranks in the sequence-parallel group (1: no sequence parallelism).
        group: the sequence-parallel group (None when ``size`` is 1).
        rank: this rank's index in it.
        data_group: the group ZeRO shards and reduces over (``sp x dp``; the data-parallel
            group when ``size`` is 1).
        data_rank: this rank's index in ``data_group``.
        data_world_size: ranks in ``data_group``.
    """

    size: int
    group: Any
    rank: int
    data_group: Any
    data_rank: int
    data_world_size: int


def sequence_groups(mpu: Any, dp_group: Any, dp_rank: int, dp_world_size: int) -> SequenceGroups:
    """The sequence-parallel groups of ``mpu`` (the data-parallel ones without a split).

    Raises:
        ValueError: the mpu has a sequence-parallel group but no sequence-data-parallel one.
    """
    size = _mpu_sp(mpu)
    if size <= 1:
        return SequenceGroups(1, None, 0, dp_group, dp_rank, dp_world_size)
    if not hasattr(mpu, "get_sequence_data_parallel_group"):
        raise ValueError(
            f"the mpu has a sequence-parallel group of {size} ranks but no "
            "get_sequence_data_parallel_group() (the sp x dp group ZeRO shards over); use "
            "ds_comm.ParallelGrid(sp=...).mpu() or add it"
        )
    data_group = mpu.get_sequence_data_parallel_group()
    return SequenceGroups(
        size=size,
        group=mpu.get_sequence_parallel_group(),
        rank=int(mpu.get_sequence_parallel_rank()),
        data_group=data_group,
        data_rank=ds_comm.get_rank(data_group),
        data_world_size=ds_comm.get_world_size(data_group),
    )


def check_sequence_composition(engine: Any, configured: int) -> None:
    """Refuse what the engine's sequence parallelism does not compose with.

    Raises:
        ConfigError: ``sequence_parallel_size`` disagrees with the mpu the engine was given
            (an engine built without ``initialize``), or MoE layers run with a sequence split.
    """
    size = engine.sequence_parallel_size
    if configured > 1 and size != configured:
        raise ConfigError(
            f"{_KEY} = {configured} but the engine's mpu has a sequence-parallel group of "
            f"{size} rank(s); build the engine with deepspeed.initialize() (it builds the axis) "
            f"or pass an mpu with that sequence axis"
        )
    if size > 1 and engine.expert_groups is not None:
        raise ConfigError(
            f"{_KEY} = {size} with MoE layers: sequence parallelism with expert parallelism is "
            "not implemented in ds; use sequence_parallel_size 1 or a dense model"
        )


def refuse_sequence_parallel_pipeline(raw: Any, mesh_param: Any) -> None:
    """Refuse a sequence split of a ``PipelineModule`` (not implemented).

    Raises:
        NotImplementedError: ``sequence_parallel_size > 1`` or ``mesh_param`` was given.
    """
    size = check_sequence_parallel_size(raw.get(_KEY))
    if size > 1 or mesh_param is not None:
        raise NotImplementedError(
            f"{_KEY} = {size} (mesh_param={mesh_param!r}) with a PipelineModule: sequence "
            f"parallelism inside pipeline stages is not implemented in ds; remove {_KEY}"
        )
