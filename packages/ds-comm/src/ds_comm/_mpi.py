"""mpi4py discovery: under ``mpirun``/``mpiexec`` with no rendezvous variables, rank 0 picks its
address and a free port and broadcasts them over ``MPI.COMM_WORLD`` (DeepSpeed's ``mpi_discovery``).

``mpi4py.MPI`` is imported only by :func:`load_mpi`, when an MPI launch is detected, because
importing it initialises MPI; the rest of this module (addresses, free ports) imports nothing
heavy, and ``_init.py`` uses :func:`free_port` for a process with no launcher too.
"""

from __future__ import annotations

import contextlib
import importlib.util
import socket
from collections.abc import Mapping
from typing import Any

from ds_comm._env import DEFAULT_PORT, LaunchEnv, local_rank_from_env

__all__ = ["discover_via_mpi", "free_port", "host_address", "load_mpi"]

# Not SLURM_LOCALID: under mpirun inside sbatch every rank inherits the batch step's value.
_MPI_LOCAL_RANK_VARS = (
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "PMI_LOCAL_RANK",
    "MV2_COMM_WORLD_LOCAL_RANK",
)


def load_mpi() -> Any | None:
    """``mpi4py.MPI``, or None when mpi4py is not installed or its MPI library cannot load."""
    if importlib.util.find_spec("mpi4py") is None:
        return None
    try:
        from mpi4py import MPI  # pyright: ignore[reportMissingImports]  (optional extra)
    except (ImportError, RuntimeError, OSError):
        return None
    return MPI


def host_address() -> str:
    """An address of this host that other hosts can reach (the outbound interface's)."""
    try:
        # A UDP connect sends nothing; it only asks the kernel which interface routes outward.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 1))
            address = probe.getsockname()[0]
        if not address.startswith("0."):
            return address
    except OSError:
        pass
    with contextlib.suppress(OSError):
        return socket.gethostbyname(socket.gethostname())
    return "127.0.0.1"


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Same option the rendezvous store sets, so TIME_WAIT leftovers don't count as taken.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def free_port(preferred: int = DEFAULT_PORT) -> int:
    """``preferred`` when nothing is bound to it on this host, else a free ephemeral port."""
    if _port_is_free(preferred):
        return preferred
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def discover_via_mpi(
    mpi: Any,
    env: Mapping[str, str],
    *,
    distributed_port: int = DEFAULT_PORT,
    rank: int = -1,
    world_size: int = -1,
) -> LaunchEnv:
    """Rank and size from ``COMM_WORLD``; rank 0's address and port broadcast to every rank.

    Rank 0 keeps ``MASTER_ADDR``/``MASTER_PORT`` when its environment has them. The local rank is
    the launcher's variable when set, else this rank's position among the ranks reporting the
    same processor name. Explicit ``rank``/``world_size`` override ``COMM_WORLD``. Collective
    over ``COMM_WORLD``: every rank must call it.
    """
    comm = mpi.COMM_WORLD
    mpi_rank, mpi_size = comm.Get_rank(), comm.Get_size()
    master = None
    if mpi_rank == 0:
        addr = env.get("MASTER_ADDR") or host_address()
        port = int(env["MASTER_PORT"]) if env.get("MASTER_PORT") else free_port(distributed_port)
        master = (addr, port)
    master_addr, master_port = comm.bcast(master, root=0)

    names = comm.allgather(mpi.Get_processor_name())
    if any(name in env for name in _MPI_LOCAL_RANK_VARS):
        local_rank = local_rank_from_env(env)
    else:
        local_rank = names[:mpi_rank].count(names[mpi_rank])
    return LaunchEnv(
        rank=rank if rank >= 0 else mpi_rank,
        world_size=world_size if world_size >= 1 else mpi_size,
        local_rank=local_rank,
        master_addr=master_addr,
        master_port=master_port,
        source="mpi4py",
    )
