"""``deepspeed.utils.groups``: the process groups of the running job, looked up by role.

DeepSpeed keeps these as module globals set by its engine, and clients read them without
arguments (Accelerate and transformers call ``groups._get_sequence_parallel_group()`` and its
siblings), so this module keeps the same shape: :data:`mpu` is the model-parallel unit the
engine was given (``groups.mpu = mpu``, as DeepSpeed's engine does; None for pure data
parallelism), and :func:`register_expert_groups` records ds-moe's expert groups. Without an mpu
the data-parallel group is every rank, the model-parallel world is one rank and there is no
sequence-parallel group. The ``_get_*`` names are DeepSpeed's (private there, used by clients).

[Note: groups read the one grid]
When the engine's mpu carries a ``ds_comm.ParallelGrid`` (the mpu ``initialize()`` builds for
``tensor_parallel.autotp_size`` / ``sequence_parallel_size``, a pipeline's ``PipelineModule.mpu()``
and ``PipelineParallelGrid``), the data, tensor, pipeline and sequence accessors answer from that
grid (:func:`get_parallel_grid`), so they name the very groups the features run on. A client's
own mpu (Megatron's ``parallel_state``) without a grid is asked directly, as DeepSpeed does.
Expert accessors answer from ds-moe's registered expert groups, by ``ep_size_<n>`` name.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch.distributed as dist

import ds_comm
from ds_comm import ParallelGrid

__all__ = [
    "mpu",
    "initialize",
    "register_expert_groups",
    "get_parallel_grid",
    # pipeline parallel (ds's: DeepSpeed asks the mpu)
    "_get_pipe_parallel_group",
    "_get_pipe_parallel_world_size",
    "_get_pipe_parallel_rank",
    # data parallel
    "_get_data_parallel_group",
    "_get_data_parallel_group_ranks",
    "_get_data_parallel_world_size",
    "_get_data_parallel_rank",
    "_get_broadcast_src_rank",
    "get_data_parallel_group",
    "get_data_parallel_world_size",
    "get_data_parallel_rank",
    # model / tensor parallel
    "_get_model_parallel_world_size",
    "get_model_parallel_group",
    "get_model_parallel_world_size",
    "get_model_parallel_rank",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_world_size",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    # sequence parallel
    "_get_sequence_parallel_group",
    "_get_sequence_parallel_world_size",
    "_get_sequence_parallel_rank",
    "_get_sequence_data_parallel_group",
    "_get_sequence_data_parallel_world_size",
    "_get_sequence_data_parallel_rank",
    # expert parallel
    "_get_expert_parallel_group",
    "_get_expert_parallel_group_dict",
    "_get_expert_parallel_group_ranks",
    "_get_expert_parallel_world_size",
    "_get_expert_parallel_rank",
    "_get_expert_parallel_src_rank",
    "_get_expert_data_parallel_group",
    "_get_expert_data_parallel_group_dict",
    "_get_expert_data_parallel_group_ranks",
    "_get_expert_data_parallel_world_size",
    "_get_expert_data_parallel_rank",
    "_get_expert_broadcast_src_rank",
    "_get_max_expert_size",
    "_get_max_expert_size_name",
    "_get_max_expert_parallel_group",
    "_get_expert_model_parallel_world_size",
]

# The model-parallel unit the engine runs with (DeepSpeed's ``groups.mpu``; None: none).
mpu: Any = None
# ds-moe ExpertGroup records by name (``ep_size_<n>``), from register_expert_groups.
_expert_groups: dict[str, Any] = {}


def initialize(ep_size: int = 1, mpu: Any = None) -> None:
    """Refused, as in DeepSpeed (deprecated there): expert groups come from the MoE layers."""
    raise RuntimeError(
        "deepspeed.utils.groups.initialize() is deprecated in DeepSpeed and not implemented in "
        "ds: pass ep_size to deepspeed.moe.layer.MoE(...) and the mpu to deepspeed.initialize()"
    )


def register_expert_groups(groups: Iterable[Any]) -> None:
    """Record the expert groups of the job's MoE layers (ds-moe's ``ExpertParallelGroups`` or
    any iterable of its ``ExpertGroup``), replacing earlier ones; the engine calls it."""
    _expert_groups.clear()
    for group in groups:
        _expert_groups[group.name] = group


def get_parallel_grid() -> ParallelGrid | None:
    """The ``ds_comm.ParallelGrid`` of the engine's mpu (see [Note: groups read the one grid]):
    the mpu itself, its ``grid`` (a ``GridMpu``), or the ``parallel_grid`` of its grid or of a
    ``PipelineParallelGrid``; None without one."""
    return ParallelGrid.of(mpu)


def _require_dist(what: str) -> None:
    if not ds_comm.is_initialized():
        raise RuntimeError(
            f"{what} needs the distributed backend: call deepspeed.init_distributed() (or "
            "deepspeed.initialize) first"
        )


# --- data parallel -----------------------------------------------------------------------------


def _get_data_parallel_group() -> Any:
    """The data-parallel group: the mpu's, else every rank (``dist.group.WORLD``)."""
    _require_dist("the data-parallel group")
    if (grid := get_parallel_grid()) is not None:
        return grid.get_group("dp")
    if mpu is not None:
        return mpu.get_data_parallel_group()
    return dist.group.WORLD


def _get_data_parallel_group_ranks() -> Sequence[int]:
    """Global ranks of this rank's data-parallel group."""
    _require_dist("the data-parallel group")
    if (grid := get_parallel_grid()) is not None:
        return grid.ranks_of("dp")
    if mpu is not None and hasattr(mpu, "get_data_parallel_group_ranks"):
        return mpu.get_data_parallel_group_ranks()
    return dist.get_process_group_ranks(_get_data_parallel_group())


def _get_data_parallel_world_size() -> int:
    """Ranks in the data-parallel group."""
    _require_dist("the data-parallel world size")
    if (grid := get_parallel_grid()) is not None:
        return grid.axis_world_size("dp")
    if mpu is not None:
        return mpu.get_data_parallel_world_size()
    return ds_comm.get_world_size()


def _get_data_parallel_rank() -> int:
    """This rank's index in the data-parallel group."""
    _require_dist("the data-parallel rank")
    if (grid := get_parallel_grid()) is not None:
        return grid.axis_rank("dp")
    if mpu is not None:
        return mpu.get_data_parallel_rank()
    return ds_comm.get_rank()


def _get_broadcast_src_rank() -> int:
    """Global rank of the first rank of the (sequence-)data-parallel group."""
    return dist.get_global_rank(_get_sequence_data_parallel_group(), 0)


get_data_parallel_group = _get_data_parallel_group
get_data_parallel_world_size = _get_data_parallel_world_size
get_data_parallel_rank = _get_data_parallel_rank


# --- model / tensor parallel -------------------------------------------------------------------


def _get_model_parallel_world_size() -> int:
    """Ranks in the model-parallel group (1 without an mpu)."""
    return 1 if mpu is None else mpu.get_model_parallel_world_size()


def _need_mpu(what: str) -> Any:
    if mpu is None:
        raise RuntimeError(
            f"{what}: no model-parallel unit is set; pass mpu= to deepspeed.initialize() (or set "
            "deepspeed.utils.groups.mpu). Without tensor parallelism the model-parallel world is "
            "one rank: see _get_model_parallel_world_size()"
        )
    return mpu


def get_tensor_model_parallel_group() -> Any:
    """The tensor (model) parallel group: the grid's ``tp``, else the mpu's."""
    if (grid := get_parallel_grid()) is not None:
        return grid.get_group("tp")
    return _need_mpu("the tensor-parallel group").get_model_parallel_group()


def get_tensor_model_parallel_world_size() -> int:
    """Ranks in the tensor-parallel group: the grid's ``tp``, else the mpu's."""
    if (grid := get_parallel_grid()) is not None:
        return grid.axis_world_size("tp")
    return _need_mpu("the tensor-parallel world size").get_model_parallel_world_size()


def get_tensor_model_parallel_rank() -> int:
    """This rank's index in the tensor-parallel group: the grid's ``tp``, else the mpu's."""
    if (grid := get_parallel_grid()) is not None:
        return grid.axis_rank("tp")
    return _need_mpu("the tensor-parallel rank").get_model_parallel_rank()


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of the first rank of this rank's tensor-parallel group (DeepSpeed's rule:
    tensor-parallel groups are consecutive ranks)."""
    size = get_tensor_model_parallel_world_size()
    return (ds_comm.get_rank() // size) * size


get_model_parallel_group = get_tensor_model_parallel_group
get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_rank = get_tensor_model_parallel_rank


# --- sequence parallel -------------------------------------------------------------------------


def _get_sequence_parallel_group() -> Any:
    """The sequence-parallel group: the grid's ``sp``, else an mpu's that has one; KeyError
    otherwise (DeepSpeed's)."""
    if (grid := get_parallel_grid()) is not None:
        return grid.get_group("sp")
    if mpu is None or not hasattr(mpu, "get_sequence_parallel_group"):
        raise KeyError(
            "No sequence parallel group found: the mpu given to deepspeed.initialize() has no "
            "get_sequence_parallel_group()"
        )
    return mpu.get_sequence_parallel_group()


def _from_grid_or_mpu(axis: str, what: str, fallback: Any) -> Any:
    """``what`` (``group``/``rank``/``world_size``) of ``axis``: the grid's, else the mpu's
    ``get_<mpu name>_<what>()`` when it has one, else ``fallback()``."""
    if (grid := get_parallel_grid()) is not None:
        if what == "group":
            return grid.get_group(axis)
        return grid.axis_rank(axis) if what == "rank" else grid.axis_world_size(axis)
    names = {"sp": "sequence_parallel", "pp": "pipe_parallel"}
    getter = getattr(mpu, f"get_{names.get(axis, axis)}_{what}", None)
    return getter() if getter is not None else fallback()


def _get_sequence_parallel_world_size() -> int:
    """Ranks in the sequence-parallel group (1 without one)."""
    return _from_grid_or_mpu("sp", "world_size", lambda: 1)


def _get_sequence_parallel_rank() -> int:
    """This rank's index in the sequence-parallel group (0 without one)."""
    return _from_grid_or_mpu("sp", "rank", lambda: 0)


def _get_sequence_data_parallel_group() -> Any:
    """The group ZeRO shards over with sequence parallelism (data x sequence), else the
    data-parallel group."""
    return _from_grid_or_mpu("sequence_data_parallel", "group", _get_data_parallel_group)


def _get_sequence_data_parallel_world_size() -> int:
    """Ranks in :func:`_get_sequence_data_parallel_group`."""
    return _from_grid_or_mpu("sequence_data_parallel", "world_size", _get_data_parallel_world_size)


def _get_sequence_data_parallel_rank() -> int:
    """This rank's index in :func:`_get_sequence_data_parallel_group`."""
    return _from_grid_or_mpu("sequence_data_parallel", "rank", _get_data_parallel_rank)


# --- pipeline parallel (ds's: DeepSpeed's module has none; its clients ask the mpu) ------------


def _get_pipe_parallel_group() -> Any:
    """The group of this rank's pipeline (every stage of its replica): the grid's ``pp``, else
    the mpu's ``get_pipe_parallel_group()``; KeyError without either."""

    def missing() -> Any:
        raise KeyError(
            "No pipeline parallel group found: the engine's mpu has no ParallelGrid and no "
            "get_pipe_parallel_group()"
        )

    return _from_grid_or_mpu("pp", "group", missing)


def _get_pipe_parallel_world_size() -> int:
    """Pipeline stages (1 without a pipeline)."""
    return _from_grid_or_mpu("pp", "world_size", lambda: 1)


def _get_pipe_parallel_rank() -> int:
    """This rank's pipeline stage (0 without a pipeline)."""
    return _from_grid_or_mpu("pp", "rank", lambda: 0)


# --- expert parallel ---------------------------------------------------------------------------


def _expert(group_name: str) -> Any:
    if group_name not in _expert_groups:
        raise KeyError(
            f"expert parallel group {group_name!r} is not initialized; known: "
            f"{sorted(_expert_groups)} (groups exist once deepspeed.initialize() saw the model's "
            "MoE layers)"
        )
    return _expert_groups[group_name]


def _get_expert_parallel_group(group_name: str) -> Any:
    """The expert-parallel group of ``ep_size_<n>`` (None for a one-rank group)."""
    return _expert(group_name).expert_parallel_group


def _get_expert_parallel_group_ranks(group_name: str) -> tuple[int, ...]:
    """Global ranks of this rank's expert-parallel group."""
    return _expert(group_name).expert_parallel_ranks


def _get_expert_parallel_group_dict() -> dict[str, Any]:
    """Name -> expert-parallel group."""
    return {name: g.expert_parallel_group for name, g in _expert_groups.items()}


def _get_expert_data_parallel_group(group_name: str) -> Any:
    """The expert-data-parallel group of ``ep_size_<n>`` (None for a one-rank group)."""
    return _expert(group_name).expert_data_parallel_group


def _get_expert_data_parallel_group_ranks(group_name: str) -> tuple[int, ...]:
    """Global ranks of this rank's expert-data-parallel group."""
    return _expert(group_name).expert_data_parallel_ranks


def _get_expert_data_parallel_group_dict() -> dict[str, Any]:
    """Name -> expert-data-parallel group."""
    return {name: g.expert_data_parallel_group for name, g in _expert_groups.items()}


def _get_expert_parallel_world_size(group_name: str) -> int:
    """Ranks in the expert-parallel group."""
    return len(_get_expert_parallel_group_ranks(group_name))


def _get_expert_parallel_rank(group_name: str) -> int:
    """This rank's index in the expert-parallel group."""
    group = _expert(group_name)
    return group.expert_parallel_ranks.index(group.rank)


def _get_expert_parallel_src_rank(group_name: str) -> int:
    """Global rank of the first rank of this rank's expert-parallel group."""
    return _get_expert_parallel_group_ranks(group_name)[0]


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    """Ranks in the expert-data-parallel group."""
    return len(_get_expert_data_parallel_group_ranks(group_name))


def _get_expert_data_parallel_rank(group_name: str) -> int:
    """This rank's index in the expert-data-parallel group."""
    group = _expert(group_name)
    return group.expert_data_parallel_ranks.index(group.rank)


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    """Global rank of the first rank of this rank's expert-data-parallel group."""
    return _get_expert_data_parallel_group_ranks(group_name)[0]


def _get_max_expert_size() -> int | None:
    """The largest ``ep_size`` of the job's MoE layers (None without any)."""
    sizes = [g.ep_size for g in _expert_groups.values()]
    return max(sizes) if sizes else None


def _get_max_expert_size_name() -> str:
    """``ep_size_<largest>``."""
    return f"ep_size_{_get_max_expert_size()}"


def _get_max_expert_parallel_group() -> Any:
    """The expert-parallel group of the largest ``ep_size``."""
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_model_parallel_world_size() -> int:
    """Tensor-parallel size of experts: ds-moe does not split experts by tensor parallelism."""
    return 1
