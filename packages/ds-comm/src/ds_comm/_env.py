"""Launch-environment discovery: who am I, how many are we, where is rank 0.

Pure functions over a mapping (normally ``os.environ``), so every launcher's conventions can be
unit-tested without processes. The mpi4py path lives in ``_mpi.py``; process-group creation in
``_init.py``.

[Note: discovery precedence]
Sources are tried in a fixed order and the first one with any of its variables set wins:

1. ``RANK``/``WORLD_SIZE`` (torchrun, ds-launch, hand-written): a launcher that sets exactly what
   ``torch.distributed`` reads has said the most specific thing, so it beats everything else.
2. OpenMPI (``OMPI_COMM_WORLD_*``), then MPICH / Intel MPI (``PMI_RANK``/``PMI_SIZE``).
3. Slurm (``SLURM_PROCID``/``SLURM_NTASKS``). It comes last because ``mpirun`` inside an
   ``sbatch`` script leaves every MPI rank with the batch step's ``SLURM_PROCID=0``; the MPI
   variables are the ones describing the processes that actually exist. For the same reason the
   step's ``SLURM_STEP_NUM_TASKS``/``SLURM_STEP_NODELIST`` are preferred over the job's.

A source whose variables are only half there is an error naming the missing ones, never a silent
fall-through to the next source: a half-set environment means the launch is misconfigured and
guessing would hang ``init_process_group`` instead of failing fast.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from ds_comm.api import DistributedEnvError

__all__ = [
    "DEFAULT_PORT",
    "LaunchEnv",
    "discover",
    "expand_hostlist",
    "local_rank_from_env",
    "mpi_env_detected",
]

DEFAULT_PORT = 29500
_LOCALHOST = "127.0.0.1"


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as discovered from its launcher.

    Attributes:
        rank: global rank of this process.
        world_size: number of processes in the job.
        local_rank: rank among the processes on this host (selects the GPU).
        master_addr: address of rank 0's rendezvous store.
        master_port: port of rank 0's rendezvous store.
        source: what the values came from: ``torchrun``, ``openmpi``, ``mpich``, ``slurm``,
            ``mpi4py``, ``args`` (explicit arguments only), ``single`` (no launcher at all) or
            ``existing`` (an already initialised default group was adopted).
    """

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str

    def export(self, environ: MutableMapping[str, str]) -> None:
        """Write the variables ``torch.distributed``'s ``env://`` reads, as DeepSpeed does."""
        environ["RANK"] = str(self.rank)
        environ["WORLD_SIZE"] = str(self.world_size)
        environ["LOCAL_RANK"] = str(self.local_rank)
        environ["MASTER_ADDR"] = self.master_addr
        environ["MASTER_PORT"] = str(self.master_port)


@dataclass(frozen=True)
class _Source:
    name: str
    rank: tuple[str, ...]
    size: tuple[str, ...]
    local_rank: tuple[str, ...]
    hint: str


# Order matters: see [Note: discovery precedence].
_SOURCES = (
    _Source(
        "torchrun",
        ("RANK",),
        ("WORLD_SIZE",),
        ("LOCAL_RANK",),
        "torchrun and ds-launch set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT",
    ),
    _Source(
        "openmpi",
        ("OMPI_COMM_WORLD_RANK",),
        ("OMPI_COMM_WORLD_SIZE",),
        ("OMPI_COMM_WORLD_LOCAL_RANK",),
        "OpenMPI's mpirun sets OMPI_COMM_WORLD_RANK, _SIZE and _LOCAL_RANK",
    ),
    _Source(
        "mpich",
        ("PMI_RANK",),
        ("PMI_SIZE",),
        ("MPI_LOCALRANKID", "PMI_LOCAL_RANK"),
        "MPICH / Intel MPI's mpiexec sets PMI_RANK, PMI_SIZE and MPI_LOCALRANKID",
    ),
    _Source(
        "slurm",
        ("SLURM_PROCID",),
        ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
        ("SLURM_LOCALID",),
        "srun sets SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID",
    ),
)
_MPI_SOURCES = ("openmpi", "mpich")
_SLURM_NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
# Every local-rank variable any supported launcher sets, for get_local_rank() after the fact.
_LOCAL_RANK_VARS = (
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "PMI_LOCAL_RANK",
    "MV2_COMM_WORLD_LOCAL_RANK",
    "SLURM_LOCALID",
)


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        value = env.get(name)
        if value is not None and value != "":
            return name, value
    return None


def _as_int(name: str, value: str, *, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise DistributedEnvError(f"{name}={value!r} is not an integer") from None
    if number < minimum:
        raise DistributedEnvError(f"{name}={value!r} must be >= {minimum}")
    return number


def _detect(env: Mapping[str, str]) -> _Source | None:
    for source in _SOURCES:
        if _first(env, source.rank) or _first(env, source.size):
            return source
    return None


def mpi_env_detected(env: Mapping[str, str]) -> bool:
    """True when an MPI launcher (OpenMPI, MPICH, Intel MPI) started this process and no
    torchrun-style ``RANK``/``WORLD_SIZE`` overrides it, i.e. when mpi4py discovery applies."""
    source = _detect(env)
    return source is not None and source.name in _MPI_SOURCES


def local_rank_from_env(env: Mapping[str, str]) -> int:
    """This process's rank on its host from whichever launcher variable is set, else 0
    (DeepSpeed's ``get_local_rank_from_launcher``)."""
    found = _first(env, _LOCAL_RANK_VARS)
    return 0 if found is None else _as_int(found[0], found[1], minimum=0)


def discover(
    env: Mapping[str, str],
    *,
    rank: int = -1,
    world_size: int = -1,
    default_port: int = DEFAULT_PORT,
    require_master: bool = True,
) -> LaunchEnv:
    """Read rank, world size, local rank and rank 0's address from a launcher's environment.

    Args:
        env: the environment, normally ``os.environ``.
        rank: explicit global rank; overrides the environment when >= 0.
        world_size: explicit world size; overrides the environment when >= 1.
        default_port: ``MASTER_PORT`` when the environment has none (DeepSpeed's
            ``distributed_port``).
        require_master: False when the caller rendezvouses some other way (an ``init_method``
            such as ``tcp://`` or ``file://``), so a missing ``MASTER_ADDR`` is no error.

    Raises:
        DistributedEnvError: the environment is half set (the message names the missing
            variables and how to set them) or holds a malformed value.

    Example:
        >>> discover({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
        ...           "MASTER_ADDR": "10.0.0.1"}).source
        'mpich'
    """
    source = _detect(env)
    explicit = rank >= 0 or world_size >= 1
    found_rank = _first(env, source.rank) if source else None
    found_size = _first(env, source.size) if source else None
    missing = []
    if rank < 0 and source and found_rank is None:
        missing.append(" or ".join(source.rank))
    if world_size < 1 and source and found_size is None:
        missing.append(" or ".join(source.size))
    if missing:
        assert source is not None  # only a detected launcher's variables can be missing
        present = [name for name in (*source.rank, *source.size) if _first(env, (name,))]
        raise DistributedEnvError(
            f"incomplete {source.name} launch environment: {', '.join(present)} set but "
            f"{' and '.join(missing)} missing; {source.hint} (or pass rank= and world_size= "
            f"to init_distributed explicitly)"
        )

    if world_size < 1:
        world_size = _as_int(*found_size, minimum=1) if found_size else 1
    if rank < 0:
        rank = _as_int(*found_rank, minimum=0) if found_rank else 0
    if rank >= world_size:
        raise DistributedEnvError(f"rank {rank} is out of range for world size {world_size}")
    name = source.name if source else ("args" if explicit else "single")

    local_rank = _local_rank(env, source, world_size)
    master_addr = _master_addr(env, source, world_size, require_master)
    found_port = _first(env, ("MASTER_PORT",))
    port = _as_int(*found_port, minimum=1) if found_port else default_port
    if port > 65535:
        raise DistributedEnvError(f"MASTER_PORT={port} is not a TCP port (1..65535)")
    return LaunchEnv(rank, world_size, local_rank, master_addr, port, name)


def _local_rank(env: Mapping[str, str], source: _Source | None, world_size: int) -> int:
    names = ("LOCAL_RANK", *source.local_rank) if source else ("LOCAL_RANK",)
    found = _first(env, names)
    if found is not None:
        return _as_int(*found, minimum=0)
    if world_size == 1:
        return 0
    # Guessing would put two ranks on one GPU (or leave GPUs idle) without a word.
    raise DistributedEnvError(
        f"world size {world_size} but no local rank: set {' or '.join(dict.fromkeys(names))} "
        f"(the rank of this process among those on its host)"
    )


def _master_addr(
    env: Mapping[str, str], source: _Source | None, world_size: int, require_master: bool
) -> str:
    found = _first(env, ("MASTER_ADDR",))
    if found is not None:
        return found[1]
    if source is not None and source.name == "slurm":
        nodelist = _first(env, _SLURM_NODELISTS)
        if nodelist is not None:
            try:
                return expand_hostlist(nodelist[1])[0]
            except ValueError as exc:
                raise DistributedEnvError(f"{nodelist[0]}: {exc}") from None
    if world_size == 1 or not require_master:
        return _LOCALHOST
    fix = "set MASTER_ADDR (and MASTER_PORT) to rank 0's host"
    if source is not None and source.name in _MPI_SOURCES:
        fix += ", or install mpi4py (pip install 'ds-comm[mpi]') so rank 0 broadcasts its address"
    elif source is not None and source.name == "slurm":
        fix += ", or export SLURM_NODELIST (srun sets it)"
    raise DistributedEnvError(
        f"MASTER_ADDR is missing and world size is {world_size} "
        f"({source.name if source else 'explicit arguments'}): {fix}"
    )


_BRACKET = re.compile(r"\[([^\[\]]*)\]")


def expand_hostlist(spec: str) -> list[str]:
    """Expand a Slurm hostlist into host names, in order.

    Supports comma-separated items, zero-padded numeric ranges and several bracket groups in
    one name (expanded as a cartesian product, leftmost slowest, as ``scontrol show hostnames``).

    Raises:
        ValueError: unbalanced brackets, an empty item or a malformed range.

    Example:
        >>> expand_hostlist("node[01-03,7],gpu-a1")
        ['node01', 'node02', 'node03', 'node7', 'gpu-a1']
        >>> expand_hostlist("r[1-2]n[8-9]")
        ['r1n8', 'r1n9', 'r2n8', 'r2n9']
    """
    hosts: list[str] = []
    for item in _split_top_level(spec.strip()):
        hosts.extend(_expand_item(item))
    if not hosts:
        raise ValueError(f"empty hostlist {spec!r}")
    return hosts


def _split_top_level(spec: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, char in enumerate(spec):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' in hostlist {spec!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in hostlist {spec!r}")
        elif char == "," and depth == 0:
            items.append(spec[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in hostlist {spec!r}")
    items.append(spec[start:])
    for item in items:
        if not item.strip():
            raise ValueError(f"empty item in hostlist {spec!r}")
    return [item.strip() for item in items]


def _expand_item(item: str) -> list[str]:
    match = _BRACKET.search(item)
    if match is None:
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    tails = _expand_item(tail)
    return [head + number + rest for number in _expand_range(match.group(1)) for rest in tails]


def _expand_range(body: str) -> list[str]:
    numbers: list[str] = []
    for part in body.split(","):
        part = part.strip()
        low, sep, high = part.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"bad range {part!r} in [{body}]")
        if not sep:
            numbers.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"descending range {part!r} in [{body}]")
        # Slurm pads to the width of the lower bound: [08-10] -> 08 09 10.
        width = len(low)
        numbers.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return numbers
