"""Messages exchanged between the harness (parent) and its rank workers.

Every message is pickled with plain :mod:`pickle` and sent with ``Connection.send_bytes``; the
test body's arguments and return value travel as separately pickled ``bytes`` so the worker can
load the test module before unpickling objects that may be defined in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker process is for, fixed for its lifetime (passed as JSON on its command line)."""

    rank: int
    world_size: int
    backend: str
    init_process_group: bool
    store_path: str
    """File store used for the first ``init_process_group`` (unique per pool)."""
    stack_path: str
    """File that ``faulthandler`` writes every thread's stack to on SIGUSR1."""


@dataclass(frozen=True)
class Call:
    """Parent -> worker: run ``qualname`` from ``module_path`` as ``fn(rank, world_size, ...)``."""

    module_name: str
    module_path: str
    qualname: str
    payload: bytes
    """``pickle.dumps((args, kwargs))``."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for this call only."""
    store_path: str = ""
    """Fresh file store used if the body destroyed the default process group."""


@dataclass(frozen=True)
class Shutdown:
    """Parent -> worker: leave the main loop and exit."""


@dataclass(frozen=True)
class Ready:
    """Worker -> parent: start-up (imports, process-group init) finished."""

    rank: int
    pid: int


@dataclass(frozen=True)
class Done:
    """Worker -> parent: the body returned; ``value`` is its pickled return value."""

    rank: int
    value: bytes


@dataclass(frozen=True)
class Failed:
    """Worker -> parent: start-up or the body raised; ``traceback`` is the formatted traceback."""

    rank: int
    traceback: str


@dataclass(frozen=True)
class SpawnRequest:
    """Parent -> fork server: fork a worker for ``spec`` (its socket travels as SCM_RIGHTS)."""

    request_id: int
    spec: WorkerSpec
    env: dict[str, str]
    log_path: str
    cwd: str


@dataclass(frozen=True)
class Spawned:
    """Fork server -> parent: the worker of ``request_id`` has ``pid``."""

    request_id: int
    pid: int


@dataclass(frozen=True)
class Exited:
    """Fork server -> parent: worker ``pid`` ended with ``code`` (negative: killed by a signal)."""

    pid: int
    code: int
