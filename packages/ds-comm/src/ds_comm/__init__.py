"""ds-comm: process-group setup, collectives, topology, comms logging, bucketing, compressed allreduce.

Mirrors ``torch.distributed`` signatures (DeepSpeed users know it as ``deepspeed.comm``), so
``import ds_comm as dist`` is a drop-in for the functional API, with hang forensics and comms
logging built in.
"""

from __future__ import annotations

from ds_comm import _exit  # noqa: F401  (registers the exit hook)
from ds_comm._bucketing import Bucket, flatten_into_buckets, unflatten_bucket
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
from ds_comm._compressed import CompressedAllReduce, compressed_all_reduce
from ds_comm._env import LaunchEnv
from ds_comm._init import (
    destroy_process_group,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
    new_group,
)
from ds_comm._instrument import annotate
from ds_comm._logger import configure, get_comms_logger, log_summary
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
    DistributedEnvError,
    ReduceOp,
)

__version__ = "0.1.0"

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
    "MpuProtocol",
    # observability
    "CommsLoggerConfig",
    "configure",
    "get_comms_logger",
    "log_summary",
    "annotate",
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
    "__version__",
]
