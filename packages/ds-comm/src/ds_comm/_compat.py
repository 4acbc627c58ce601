"""The rest of ``deepspeed.comm``'s public names: group queries, capability probes, launcher helpers.

DeepSpeed keeps these beside its collectives, and client code (DeepSpeed's own ZeRO, Megatron-
DeepSpeed, transformers) calls them: ``get_global_rank``, ``get_all_ranks_from_group``,
``allgather_fn``/``reduce_scatter_fn`` (the tensor forms with a fallback on old torch), the
``has_*`` probes, the ``*_from_launcher`` environment readers and the backend-name constants.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ds_comm._collectives import all_gather_into_tensor, reduce_scatter_tensor
from ds_comm._env import DEFAULT_PORT
from ds_comm._init import _require_initialized, init_distributed
from ds_comm._instrument import TrackedWork, annotate
from ds_comm.api import ReduceOp

__all__ = [
    "CCL_BACKEND",
    "GLOO_BACKEND",
    "HCCL_BACKEND",
    "MPI_BACKEND",
    "NCCL_BACKEND",
    "TORCH_DISTRIBUTED_DEFAULT_PORT",
    "ProcessGroup",
    "allgather_fn",
    "default_pg_timeout",
    "enable_symm_mem_for_group",
    "get_all_ranks_from_group",
    "get_backend",
    "get_global_rank",
    "get_local_rank_from_launcher",
    "get_world_group",
    "get_world_rank_from_launcher",
    "get_world_size_from_launcher",
    "has_all_gather_into_tensor",
    "has_all_reduce_coalesced",
    "has_coalescing_manager",
    "has_reduce_scatter_tensor",
    "in_aml",
    "in_aws_sm",
    "in_dlts",
    "init_deepspeed_backend",
    "initialize_mesh_device",
    "is_available",
]

NCCL_BACKEND = "nccl"
GLOO_BACKEND = "gloo"
MPI_BACKEND = "mpi"
CCL_BACKEND = "ccl"
HCCL_BACKEND = "hccl"
TORCH_DISTRIBUTED_DEFAULT_PORT = DEFAULT_PORT
default_pg_timeout = timedelta(minutes=30)
_TORCH_BACKENDS = (NCCL_BACKEND, GLOO_BACKEND, MPI_BACKEND)


# --- group queries -------------------------------------------------------------------------------


def is_available() -> bool:
    """Whether ``torch.distributed`` (hence ds-comm's collectives) is built into this torch."""
    return dist.is_available()


def get_world_group() -> Any:
    """The default process group (every rank)."""
    _require_initialized("get_world_group")
    return dist.group.WORLD


def get_backend(group: Any = None) -> str:
    """The backend name of ``group`` (the default group when None), e.g. ``"gloo"``."""
    _require_initialized("get_backend")
    return str(dist.get_backend(group))


def get_global_rank(group: Any = None, group_rank: int = 0) -> int:
    """The global rank of ``group``'s rank ``group_rank`` (the default group when None)."""
    _require_initialized("get_global_rank")
    world: Any = dist.group.WORLD  # set once the default group exists (checked above)
    return dist.get_global_rank(group if group is not None else world, group_rank)


def get_all_ranks_from_group(group: Any = None) -> list[int]:
    """The global ranks of ``group`` in group-rank order (the default group when None)."""
    _require_initialized("get_all_ranks_from_group")
    return list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


# --- tensor forms DeepSpeed's ZeRO calls ---------------------------------------------------------


def allgather_fn(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
    debug: Any = None,
) -> TrackedWork | None:
    """:func:`~ds_comm.all_gather_into_tensor` (ds-comm always has the tensor form).

    ``debug`` (DeepSpeed passes its caller's name) names the call site in fingerprints and hang
    reports, like :func:`~ds_comm.annotate`.
    """
    _require_initialized("allgather_fn")
    with _site(debug):
        return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


def reduce_scatter_fn(
    output_tensor: torch.Tensor,
    tensor: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    debug: Any = None,
) -> TrackedWork | None:
    """:func:`~ds_comm.reduce_scatter_tensor` (ds-comm always has the tensor form).

    ``debug`` names the call site as in :func:`allgather_fn`. ``prof`` (DeepSpeed: log this call
    even when ``prof_all`` is off) is not implemented: ``True`` is refused; ds-comm's comms
    logger selects ops by ``prof_ops``.
    """
    _require_initialized("reduce_scatter_fn")
    if prof:
        raise NotImplementedError(
            "reduce_scatter_fn(prof=True): per-call profiling is not implemented in ds; "
            "name the op in comms_logger.prof_ops instead"
        )
    with _site(debug):
        return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def _site(debug: Any) -> contextlib.AbstractContextManager[Any]:
    return annotate(debug) if isinstance(debug, str) and debug else contextlib.nullcontext()


def has_all_gather_into_tensor() -> bool:
    """True: ds-comm's ``all_gather_into_tensor`` works on every backend (with fallbacks)."""
    _require_initialized("has_all_gather_into_tensor")
    return True


def has_reduce_scatter_tensor() -> bool:
    """True: ds-comm's ``reduce_scatter_tensor`` works on every backend (with fallbacks)."""
    _require_initialized("has_reduce_scatter_tensor")
    return True


def has_all_reduce_coalesced() -> bool:
    """True: :func:`~ds_comm.all_reduce_coalesced` is implemented (one all-reduce per dtype)."""
    _require_initialized("has_all_reduce_coalesced")
    return True


def has_coalescing_manager() -> bool:
    """False: ds-comm exposes no coalescing manager; coalesced ops flatten instead."""
    _require_initialized("has_coalescing_manager")
    return False


# --- launcher environment ------------------------------------------------------------------------


def _env_int(names: Sequence[str], default: int) -> int:
    for name in names:
        raw = os.environ.get(name)
        if raw is not None:
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not an integer") from None
    return default


def get_local_rank_from_launcher() -> int:
    """``LOCAL_RANK`` (else ``OMPI_COMM_WORLD_LOCAL_RANK``, else 0)."""
    return _env_int(("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"), 0)


def get_world_rank_from_launcher() -> int:
    """``RANK`` (else ``OMPI_COMM_WORLD_RANK``, else 0)."""
    return _env_int(("RANK", "OMPI_COMM_WORLD_RANK"), 0)


def get_world_size_from_launcher() -> int:
    """``WORLD_SIZE`` (else ``OMPI_COMM_WORLD_SIZE``, else 1)."""
    return _env_int(("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"), 1)


def in_aml() -> bool:
    """Whether this runs as an Azure ML job."""
    return "AZUREML_EXPERIMENT_ID" in os.environ


def in_aws_sm() -> bool:
    """Whether this runs as an AWS SageMaker training job."""
    return "SM_TRAINING_ENV" in os.environ


def in_dlts() -> bool:
    """Whether this runs under Microsoft's DLTS scheduler."""
    return "DLTS_JOB_ID" in os.environ


# --- setup ---------------------------------------------------------------------------------------


def init_deepspeed_backend(ds_backend: str, timeout: timedelta, init_method: str | None) -> None:
    """Initialise the default group on torch backend ``ds_backend`` (``nccl``, ``gloo``, ``mpi``).

    DeepSpeed's own backends (``ccl``, ``hccl``) are not implemented in ds and are refused.
    """
    if ds_backend not in _TORCH_BACKENDS:
        raise NotImplementedError(
            f"init_deepspeed_backend({ds_backend!r}): the {ds_backend} backend is not "
            f"implemented in ds; use one of {list(_TORCH_BACKENDS)}"
        )
    init_distributed(dist_backend=ds_backend, timeout=timeout, init_method=init_method)


def initialize_mesh_device(mesh_shape: Sequence[int], mesh_dim_names: Sequence[str]) -> Any:
    """A ``torch.distributed`` ``DeviceMesh`` of ``mesh_shape`` on the accelerator's device kind."""
    _require_initialized("initialize_mesh_device")
    from torch.distributed.device_mesh import init_device_mesh

    from ds_comm.accelerator import get_accelerator

    return init_device_mesh(
        get_accelerator().device_name(), tuple(mesh_shape), mesh_dim_names=tuple(mesh_dim_names)
    )


def enable_symm_mem_for_group(group_name: str) -> None:
    """Refused: symmetric memory is not implemented in ds."""
    raise NotImplementedError(
        f"enable_symm_mem_for_group({group_name!r}): symmetric memory is not implemented in ds"
    )
