"""ds-comm: process-group setup, collectives, topology, comms logging, bucketing, compressed allreduce.

Mirrors ``torch.distributed`` signatures and the rest of ``deepspeed.comm``, so
``import ds_comm as dist`` is a drop-in for the functional API, with hang forensics, comms
logging and a device guard built in. ``ds_comm.accelerator`` is DeepSpeed's accelerator
abstraction (``get_accelerator()``), the lowest layer of ds.
"""

from __future__ import annotations

from ds_comm import _exit  # noqa: F401  (registers the exit hook)
from ds_comm._bucketing import Bucket, flatten_into_buckets, unflatten_bucket
from ds_comm._coalesced import all_gather_coalesced, all_reduce_coalesced, inference_all_reduce
from ds_comm._collectives import (
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    force_algorithm,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
)
from ds_comm._compat import (
    CCL_BACKEND,
    GLOO_BACKEND,
    HCCL_BACKEND,
    MPI_BACKEND,
    NCCL_BACKEND,
    TORCH_DISTRIBUTED_DEFAULT_PORT,
    ProcessGroup,
    allgather_fn,
    default_pg_timeout,
    enable_symm_mem_for_group,
    get_all_ranks_from_group,
    get_backend,
    get_global_rank,
    get_local_rank_from_launcher,
    get_world_group,
    get_world_rank_from_launcher,
    get_world_size_from_launcher,
    has_all_gather_into_tensor,
    has_all_reduce_coalesced,
    has_coalescing_manager,
    has_reduce_scatter_tensor,
    in_aml,
    in_aws_sm,
    in_dlts,
    init_deepspeed_backend,
    initialize_mesh_device,
    is_available,
    reduce_scatter_fn,
)
from ds_comm._compressed import CompressedAllReduce, compressed_all_reduce
from ds_comm._device_guard import device_guard, group_device
from ds_comm._env import LaunchEnv
from ds_comm._gather_scatter import all_to_all, gather, monitored_barrier, scatter
from ds_comm._grid import GridMpu, ParallelGrid, ParallelLayout
from ds_comm._init import (
    destroy_process_group,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
    mpi_discovery,
    new_group,
)
from ds_comm._instrument import annotate
from ds_comm._logger import (
    configure,
    get_comm_operation_count,
    get_comms_logger,
    get_logged_comm_ops,
    has_comm_data,
    log_summary,
    reset_log,
)
from ds_comm._objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    scatter_object_list,
)
from ds_comm._p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from ds_comm._topology import (
    Mpu,
    MpuProtocol,
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessGrid,
    ProcessTopology,
)
from ds_comm.api import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommsLoggerConfig,
    ConfigError,
    DeviceGuardError,
    DistributedEnvError,
    ReduceOp,
)

__version__ = "0.2.0"

__all__ = [
    # setup
    "init_distributed",
    "is_initialized",
    "destroy_process_group",
    "get_rank",
    "get_world_size",
    "get_local_rank",
    "new_group",
    "LaunchEnv",
    "is_available",
    "get_backend",
    "get_world_group",
    "get_global_rank",
    "get_all_ranks_from_group",
    "init_deepspeed_backend",
    "initialize_mesh_device",
    "mpi_discovery",
    "enable_symm_mem_for_group",
    "ProcessGroup",
    # launcher environment and backend names (DeepSpeed's helpers)
    "get_local_rank_from_launcher",
    "get_world_rank_from_launcher",
    "get_world_size_from_launcher",
    "in_aml",
    "in_aws_sm",
    "in_dlts",
    "NCCL_BACKEND",
    "GLOO_BACKEND",
    "MPI_BACKEND",
    "CCL_BACKEND",
    "HCCL_BACKEND",
    "TORCH_DISTRIBUTED_DEFAULT_PORT",
    "default_pg_timeout",
    # collectives
    "ReduceOp",
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "all_to_all",
    "gather",
    "scatter",
    "all_reduce_coalesced",
    "all_gather_coalesced",
    "inference_all_reduce",
    "allgather_fn",
    "reduce_scatter_fn",
    "has_all_gather_into_tensor",
    "has_reduce_scatter_tensor",
    "has_all_reduce_coalesced",
    "has_coalescing_manager",
    "monitored_barrier",
    # object collectives
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
    "P2POp",
    "batch_isend_irecv",
    "barrier",
    "force_algorithm",
    # topology
    "ProcessTopology",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "ProcessGrid",
    "Mpu",
    "ParallelGrid",
    "ParallelLayout",
    "GridMpu",
    "MpuProtocol",
    # observability
    "CommsLoggerConfig",
    "configure",
    "get_comms_logger",
    "log_summary",
    "reset_log",
    "has_comm_data",
    "get_comm_operation_count",
    "get_logged_comm_ops",
    "annotate",
    "device_guard",
    "group_device",
    # bucketing and compression
    "Bucket",
    "flatten_into_buckets",
    "unflatten_bucket",
    "CompressedAllReduce",
    "compressed_all_reduce",
    # errors
    "ConfigError",
    "DistributedEnvError",
    "CollectiveTimeoutError",
    "CollectiveMismatchError",
    "DeviceGuardError",
    "__version__",
]
