"""Default process-group setup and the rank/size queries (``deepspeed.comm.init_distributed``).

Discovery of the launch environment is in ``_env.py`` (pure) and ``_mpi.py`` (mpi4py); this file
turns a :class:`~ds_comm._env.LaunchEnv` into an initialised ``torch.distributed`` default group.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ds_comm import _forensics
from ds_comm._env import DEFAULT_PORT, LaunchEnv, discover, local_rank_from_env, mpi_env_detected
from ds_comm._instrument import TRACKER
from ds_comm.accelerator import get_accelerator
from ds_comm.api import DistributedEnvError

__all__ = [
    "destroy_process_group",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
    "mpi_discovery",
    "new_group",
]

_DEFAULT_TIMEOUT = timedelta(minutes=30)
# Adopting an existing group is announced once per process, not on every engine construction.
_adoption_announced = False


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = DEFAULT_PORT,
    verbose: bool = True,
    timeout: timedelta = _DEFAULT_TIMEOUT,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> LaunchEnv:
    """Initialise the default process group from the launch environment (idempotent).

    Reads torchrun/ds-launch, OpenMPI, MPICH/Intel MPI or Slurm variables (see
    [Note: discovery precedence] in ``_env.py``); under an MPI launcher with mpi4py installed,
    rank 0's address and a free port are broadcast over MPI instead. The result is exported to
    ``os.environ`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).
    If a default group already exists (a second call, torchrun user code, a test harness) it is
    adopted as is.

    Args:
        dist_backend: ``nccl`` when CUDA is available, else ``gloo``, unless given.
        auto_mpi_discovery: use mpi4py to find rank 0 when launched by mpirun/mpiexec.
        distributed_port: ``MASTER_PORT`` when the environment has none (a process with no
            launcher takes a free port instead when this one is taken: nobody else connects).
        verbose: print one summary line on rank 0.
        timeout: timeout of the default group's collectives.
        init_method: torch rendezvous URL; ``env://`` (from the discovered values) when None.
        dist_init_required: ``False`` asserts a default group already exists (an error
            otherwise, as in DeepSpeed); ``None`` or ``True`` create one when there is none.
        config: a DeepSpeed config dict (or its ``comms_logger`` section, or a
            :class:`CommsLoggerConfig`) whose ``comms_logger`` settings are applied first.
        rank: explicit global rank, overriding the environment when >= 0.
        world_size: explicit world size, overriding the environment when >= 1.

    Returns:
        The launch environment used (``source="existing"`` when a group was adopted).

    Raises:
        DistributedEnvError: the launch environment is half set; the message names what is
            missing and how to fix it.

    Example:
        >>> import ds_comm
        >>> launch = ds_comm.init_distributed()   # under torchrun, mpirun, srun or alone
        >>> launch.world_size == ds_comm.get_world_size()
        True
    """
    if not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
    if config is not None:
        from ds_comm._logger import configure

        configure(_comms_section(config))
    if dist_init_required is False and not dist.is_initialized():
        raise DistributedEnvError(
            "init_distributed(dist_init_required=False) but no default process group exists; "
            "initialise torch.distributed first or pass dist_init_required=True"
        )
    if dist.is_initialized():
        adopted = _adopt_existing(rank, world_size, verbose)
        _forensics.ensure_armed()
        return adopted

    accelerator = get_accelerator()
    backend = dist_backend or accelerator.communication_backend_name()
    launch = _discover(auto_mpi_discovery, distributed_port, init_method, rank, world_size)
    launch.export(os.environ)
    if "nccl" in backend and accelerator.device_name() != "cpu":
        _set_device(launch.local_rank)
    dist.init_process_group(
        backend,
        init_method=init_method,
        timeout=timeout,
        rank=launch.rank,
        world_size=launch.world_size,
    )
    TRACKER.reset()
    _forensics.ensure_armed()
    if verbose and launch.rank == 0:
        print(
            f"[ds_comm] initialised {backend}: world_size={launch.world_size} "
            f"master={launch.master_addr}:{launch.master_port} source={launch.source}",
            file=sys.stderr,
            flush=True,
        )
    return launch


def mpi_discovery(distributed_port: int = DEFAULT_PORT, verbose: bool = True) -> LaunchEnv:
    """Learn rank, size and rank 0's address over mpi4py and export them (DeepSpeed's name).

    Collective over ``MPI.COMM_WORLD``: every rank of an ``mpirun``/``mpiexec`` job calls it.
    Afterwards ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``
    are set, so any ``env://`` initialisation works. :func:`init_distributed` does this itself
    under an MPI launcher (``auto_mpi_discovery=True``).

    Raises:
        DistributedEnvError: mpi4py is missing or its MPI library cannot load.
    """
    from ds_comm._mpi import discover_via_mpi, load_mpi

    mpi = load_mpi()
    if mpi is None:
        raise DistributedEnvError(
            "mpi_discovery: mpi4py is not installed or its MPI library cannot load; "
            "install ds-comm[mpi] (mpi4py) or launch with ds-launch/torchrun instead"
        )
    launch = discover_via_mpi(mpi, os.environ, distributed_port=distributed_port)
    launch.export(os.environ)
    if verbose and launch.rank == 0:
        print(
            f"[ds_comm] mpi_discovery: world_size={launch.world_size} "
            f"master={launch.master_addr}:{launch.master_port}",
            file=sys.stderr,
            flush=True,
        )
    return launch


def _comms_section(config: Any) -> Any:
    """The ``comms_logger`` settings in ``init_distributed``'s ``config`` (defaults when absent)."""
    from dataclasses import fields

    from ds_comm.api import CommsLoggerConfig

    if isinstance(config, CommsLoggerConfig):
        return config
    if isinstance(config, Mapping):
        if "comms_logger" in config:
            return config["comms_logger"]
        known = {f.name for f in fields(CommsLoggerConfig)}
        # a bare section, or a whole config without one (DeepSpeed then uses the defaults)
        return config if config and set(config) <= known else {}
    section = getattr(config, "comms_logger", None)  # a config object holding the section
    if section is not None:
        return section
    raise TypeError(
        f"init_distributed(config=...): expected a DeepSpeed config dict, got {type(config).__name__}"
    )


def _discover(
    auto_mpi_discovery: bool,
    distributed_port: int,
    init_method: str | None,
    rank: int,
    world_size: int,
) -> LaunchEnv:
    if auto_mpi_discovery and mpi_env_detected(os.environ):
        from ds_comm._mpi import discover_via_mpi, load_mpi

        mpi = load_mpi()
        if mpi is not None:
            return discover_via_mpi(
                mpi,
                os.environ,
                distributed_port=distributed_port,
                rank=rank,
                world_size=world_size,
            )
    launch = discover(
        os.environ,
        rank=rank,
        world_size=world_size,
        default_port=distributed_port,
        require_master=init_method is None or init_method.startswith("env://"),
    )
    if launch.source == "single" and "MASTER_PORT" not in os.environ:
        # A process alone, with no port set: nobody else connects to its store, so when the
        # port is taken (another lone job on this host: a second notebook, a second test run)
        # any free one does, where DeepSpeed fails with EADDRINUSE.
        from ds_comm._mpi import free_port

        launch = dataclasses.replace(launch, master_port=free_port(launch.master_port))
    return launch


def _adopt_existing(rank: int, world_size: int, verbose: bool) -> LaunchEnv:
    global _adoption_announced
    current_rank, current_size = dist.get_rank(), dist.get_world_size()
    if (rank >= 0 and rank != current_rank) or (world_size >= 1 and world_size != current_size):
        raise DistributedEnvError(
            f"init_distributed(rank={rank}, world_size={world_size}) but the default process "
            f"group is already initialised as rank {current_rank} of {current_size}; "
            f"call destroy_process_group() first to re-initialise"
        )
    if verbose and current_rank == 0 and not _adoption_announced:
        print(
            f"[ds_comm] adopting the initialised default group: "
            f"backend={dist.get_backend()} world_size={current_size}",
            file=sys.stderr,
            flush=True,
        )
    _adoption_announced = True
    port = os.environ.get("MASTER_PORT", "")
    return LaunchEnv(
        rank=current_rank,
        world_size=current_size,
        local_rank=local_rank_from_env(os.environ),
        master_addr=os.environ.get("MASTER_ADDR", ""),
        master_port=int(port) if port.isdigit() else 0,
        source="existing",
    )


def _set_device(local_rank: int) -> None:
    accelerator = get_accelerator()
    count = accelerator.device_count()
    if local_rank >= count:
        raise DistributedEnvError(
            f"local rank {local_rank} but this host has {count} {accelerator.device_name()} "
            f"device(s): launch at most {count} processes per host, or restrict with "
            "CUDA_VISIBLE_DEVICES consistently"
        )
    accelerator.set_device(local_rank)


def is_initialized() -> bool:
    """True once the default process group exists."""
    return dist.is_available() and dist.is_initialized()


def _require_initialized(caller: str) -> None:
    if not is_initialized():
        raise DistributedEnvError(
            f"ds_comm.{caller}: no default process group; call ds_comm.init_distributed() first"
        )


def destroy_process_group(group: Any | None = None) -> None:
    """Destroy ``group`` (the default group and all others when None)."""
    global _adoption_announced
    if group is None:
        _forensics.disarm()
    dist.destroy_process_group(group)
    if group is None:
        # Sequence numbers belong to the groups just destroyed; a new default group starts at 1.
        TRACKER.reset()
        _adoption_announced = False


def get_rank(group: Any | None = None) -> int:
    """This process's rank in ``group`` (the default group when None)."""
    _require_initialized("get_rank")
    return dist.get_rank(group)


def get_world_size(group: Any | None = None) -> int:
    """Number of ranks in ``group`` (the default group when None)."""
    _require_initialized("get_world_size")
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's rank on its host, from the launcher's environment (0 when none is set).

    Works before :func:`init_distributed` (e.g. to pick a device early); after it, ``LOCAL_RANK``
    holds the discovered value.
    """
    return local_rank_from_env(os.environ)


def new_group(
    ranks: Sequence[int] | None = None,
    timeout: timedelta | None = None,
    backend: str | None = None,
) -> Any:
    """Create a process group over ``ranks`` (all ranks when None).

    Like ``torch.distributed.new_group``, every rank of the default group must call it, in the
    same order, even ranks that are not members.
    """
    _require_initialized("new_group")
    return dist.new_group(
        ranks=None if ranks is None else list(ranks), timeout=timeout, backend=backend
    )
