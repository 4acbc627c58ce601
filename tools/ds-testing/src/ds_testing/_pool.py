"""Worker-pool lifecycle: spawn N rank workers, run calls on them, collect outcomes, kill them.

A pool is reused across ``run_on_ranks`` calls with the same :class:`PoolKey` (starting a process
and importing torch is the expensive part). After any failure or timeout the pool is killed and
the next call starts a fresh one, because collective state may be inconsistent.
See [Note: Why subprocess workers] below.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from typing import Any, Literal

from ds_testing._launch import WorkerProcess, launch_worker, stop_fork_server
from ds_testing._protocol import Call, Done, Failed, Ready, Shutdown, WorkerSpec
from ds_testing._stacks import dump_stacks

# [Note: Why subprocess workers]
# Workers are forked from a fork server or started as `python -m ds_testing._worker` (see
# [Note: Fork server] in _launch.py), never multiprocessing "spawn" children: spawn re-imports
# pytest's __main__ in every child. Each worker is a session leader, so SIGKILL of its process
# group takes anything its body started with it (no orphans). Each worker talks to the parent
# over its own socketpair, so no addresses or ports are shared between pools, threads or
# pytest-xdist workers; rendezvous uses a fresh file store.

FAILURE_GRACE_S = 5.0
"""After the first rank fails, how long the others get to report before the pool is killed."""
_STARTUP_TIMEOUT_S = 120.0
_SHUTDOWN_WAIT_S = 3.0
_POLL_S = 0.5

Status = Literal["ok", "raised", "exited", "hung"]


@dataclass(frozen=True)
class PoolKey:
    """Workers can be shared by calls that agree on all of these."""

    world_size: int
    backend: str
    init_process_group: bool


@dataclass
class RankOutcome:
    """How one rank ended one call (or start-up)."""

    rank: int
    status: Status
    value: Any = None
    detail: str = ""
    """Traceback (``raised``) or exit description (``exited``)."""
    stack: str = ""
    """Every thread's stack (``hung``)."""
    output: str = ""
    """What the rank printed during this call."""


@dataclass
class Outcome:
    """Every rank's outcome of one call, plus why unfinished ranks count as hung."""

    phase: Literal["start-up", "call"]
    ranks: list[RankOutcome]
    hang_reason: str = ""
    """E.g. ``"within 5.0 s"``."""

    @property
    def ok(self) -> bool:
        return all(r.status == "ok" for r in self.ranks)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "exited (exit code unknown)"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"exited with code {code} (killed by {name})"
    return f"exited with code {code}"


def _reserve_port() -> socket.socket:
    """Bind port 0 so the OS picks a free port; close the socket right before the port is used."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


@dataclass
class _Rank:
    proc: WorkerProcess
    conn: Connection
    log_path: str
    stack_path: str
    log_offset: int = 0


@dataclass
class WorkerPool:
    """``world_size`` worker processes that share one default process group."""

    key: PoolKey
    one_off: bool = False
    busy: bool = False
    _dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="ds-testing-"))
    _ranks: list[_Rank] = field(default_factory=list)

    @property
    def started(self) -> bool:
        return bool(self._ranks)

    def new_store_path(self) -> str:
        """A file-store path that no rendezvous has used yet."""
        return os.path.join(self._dir, f"store-{uuid.uuid4().hex}")

    def _worker_env(self, rank: int) -> dict[str, str]:
        env = os.environ.copy()
        src = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
        env.update(
            PYTHONUNBUFFERED="1",
            DS_TESTING_RANK_WORKER="1",
            OMP_NUM_THREADS="1",
            RANK=str(rank),
            WORLD_SIZE=str(self.key.world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(self.key.world_size),
            DS_TESTING_SYS_PATH=json.dumps(sys.path),
        )
        # Every collective in every rank worker checks its tensors' devices (ds-comm's device
        # guard), so the whole suite proves the device discipline; a test may turn it off.
        env.setdefault("DS_DEVICE_GUARD", "1")
        env.pop("MASTER_PORT", None)
        if not self.key.init_process_group:
            env["MASTER_ADDR"] = "127.0.0.1"
        return env

    def _spawn(self, spec: WorkerSpec) -> _Rank:
        parent_sock, child_sock = socket.socketpair()
        log_path = os.path.join(self._dir, f"rank{spec.rank}.log")
        with child_sock:
            proc = launch_worker(spec, child_sock.fileno(), self._worker_env(spec.rank), log_path)
        return _Rank(proc, Connection(parent_sock.detach()), log_path, spec.stack_path)

    def start(self, timeout: float) -> Outcome:
        """Spawn the workers and wait until each has imported torch and joined the group."""
        store_path = self.new_store_path()
        for rank in range(self.key.world_size):
            spec = WorkerSpec(
                rank=rank,
                world_size=self.key.world_size,
                backend=self.key.backend,
                init_process_group=self.key.init_process_group,
                store_path=store_path,
                stack_path=os.path.join(self._dir, f"rank{rank}.stack"),
            )
            self._ranks.append(self._spawn(spec))
        return self._gather("start-up", max(timeout, _STARTUP_TIMEOUT_S))

    def run(self, call: Call, timeout: float) -> Outcome:
        """Send ``call`` to every rank and collect their outcomes within ``timeout`` seconds."""
        port = None if self.key.init_process_group else _reserve_port()
        if port is not None:
            env = {**call.env, "MASTER_PORT": str(port.getsockname()[1])}
            call = replace(call, env=env)
            port.close()
        call = replace(call, store_path=self.new_store_path())
        data = pickle.dumps(call)
        for r in self._ranks:
            with contextlib.suppress(OSError):  # a dead worker is reported by _gather
                r.conn.send_bytes(data)
        return self._gather("call", timeout)

    def _receive(self, rank: int) -> RankOutcome:
        r = self._ranks[rank]
        try:
            message = pickle.loads(r.conn.recv_bytes())
        except (EOFError, OSError):
            try:
                detail = _describe_exit(r.proc.wait(timeout=5))
            except subprocess.TimeoutExpired:
                detail = "closed its connection but is still running"
            return RankOutcome(rank, "exited", detail=detail)
        if isinstance(message, Failed):
            return RankOutcome(rank, "raised", detail=message.traceback)
        if isinstance(message, Done):
            try:
                return RankOutcome(rank, "ok", value=pickle.loads(message.value))
            except Exception as exc:
                return RankOutcome(rank, "raised", detail=f"cannot unpickle the result: {exc!r}")
        assert isinstance(message, Ready)
        return RankOutcome(rank, "ok")

    def _gather(self, phase: Literal["start-up", "call"], timeout: float) -> Outcome:
        """Collect one message per rank; stop early (after a grace period) once one fails."""
        start = time.monotonic()
        conn_rank = {r.conn: i for i, r in enumerate(self._ranks)}
        pending = set(range(len(self._ranks)))
        done: dict[int, RankOutcome] = {}
        failed_at: float | None = None
        while pending:
            limit = start + timeout
            if failed_at is not None:
                limit = min(limit, failed_at + FAILURE_GRACE_S)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                break
            ready = wait([self._ranks[i].conn for i in pending], min(remaining, _POLL_S))
            # A worker whose socket was inherited by a grandchild gives no EOF: poll exits too.
            for i in pending:
                if self._ranks[i].conn not in ready and self._ranks[i].proc.exited():
                    ready.append(self._ranks[i].conn)
            for conn in ready:
                rank = conn_rank[conn]  # type: ignore[index]
                done[rank] = self._receive(rank)
                pending.discard(rank)
                if done[rank].status != "ok" and failed_at is None:
                    failed_at = time.monotonic()
        hang_reason = f"within {timeout:.1f} s"
        if failed_at is not None:
            first = min(r for r, o in done.items() if o.status != "ok")
            hang_reason = f"within {FAILURE_GRACE_S:.1f} s after rank {first} failed"
        if pending:
            pids = {i: self._ranks[i].proc.pid for i in pending}
            stacks = dump_stacks(pids, {i: self._ranks[i].stack_path for i in pending})
            for i in pending:
                done[i] = RankOutcome(i, "hung", stack=stacks[i])
        for i, outcome in done.items():
            outcome.output = self._read_new_output(i)
        return Outcome(phase, [done[i] for i in sorted(done)], hang_reason)

    def _read_new_output(self, rank: int) -> str:
        r = self._ranks[rank]
        try:
            with open(r.log_path, "rb") as f:
                f.seek(r.log_offset)
                data = f.read()
        except OSError:
            return ""
        r.log_offset += len(data)
        return data.decode("utf-8", "replace")

    def close(self) -> None:
        """Ask the workers to exit, then kill whatever is left."""
        for r in self._ranks:
            with contextlib.suppress(OSError):
                r.conn.send_bytes(pickle.dumps(Shutdown()))
        deadline = time.monotonic() + _SHUTDOWN_WAIT_S
        for r in self._ranks:
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """SIGKILL every worker's process group (the worker and anything its body started)."""
        for r in self._ranks:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(r.proc.pid, signal.SIGKILL)
        for r in self._ranks:
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.proc.wait(timeout=5)
            r.conn.close()
        self._ranks.clear()
        shutil.rmtree(self._dir, ignore_errors=True)


_lock = threading.Lock()
_shared: dict[PoolKey, WorkerPool] = {}
_live_pools: dict[int, WorkerPool] = {}


def acquire_pool(key: PoolKey, *, fresh: bool) -> WorkerPool:
    """Return an idle shared pool for ``key``, or a new one (one-off if ``fresh`` or contended)."""
    with _lock:
        pool = None if fresh else _shared.get(key)
        if pool is not None and not pool.busy:
            pool.busy = True
            return pool
        new = WorkerPool(key, one_off=fresh or pool is not None, busy=True)
        if not new.one_off:
            _shared[key] = new
        _live_pools[id(new)] = new
        return new


def release_pool(pool: WorkerPool, *, healthy: bool) -> None:
    """Return ``pool`` after a call; kill it if the call failed, close it if it was one-off."""
    with _lock:
        pool.busy = False
        discard = pool.one_off or not healthy
        if discard:
            _live_pools.pop(id(pool), None)
            if _shared.get(pool.key) is pool:
                del _shared[pool.key]
    if discard and healthy:
        pool.close()
    elif discard:
        pool.kill()


def shutdown_pools() -> None:
    """Close every pool (pytest session end, interpreter exit)."""
    with _lock:
        pools = list(_live_pools.values())
        _live_pools.clear()
        _shared.clear()
    for pool in pools:
        pool.close()
    stop_fork_server()


atexit.register(shutdown_pools)
