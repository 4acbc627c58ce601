"""Start rank worker processes: forked from a fork server, or as plain subprocesses.

[Note: Fork server]
Starting a Python process and importing torch takes seconds (much more with 4 ranks on 2 busy
cores), and every failure replaces a whole pool. So the first launch starts one fork server per
parent process (``_forkserver.py``) that imports torch once and forks workers on request: a pool
then starts in well under a second. Each forked worker calls ``setsid`` (its own process group,
killed as a whole), gets its own log and the environment the parent computed, and receives its
parent socket as an SCM_RIGHTS file descriptor. The fork server reaps workers and reports their
exit codes, since the parent cannot ``waitpid`` them. It exits when the parent closes its socket
or dies, killing the workers left. ``DS_TESTING_FORK_SERVER=0`` (or a fork server that fails to
start) falls back to one ``python -m ds_testing._worker`` subprocess per rank.
Caveat: variables read only at import time (e.g. by torch) come from the environment of the
first launch, because the import happened in the fork server. A suite whose every worker imports
something slow names it with ``ds_testing.preload`` (from its ``conftest.py``), and the fork
server imports that once too: the first torch optimizer a process builds imports
``torch._dynamo``, 2.5 s of a worker's start on the 2-core VM. Suites that build no optimizer
leave it out, since the fork server's own start would pay it for nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from typing import Protocol

from ds_testing._forkserver import MAX_MESSAGE
from ds_testing._protocol import Exited, Spawned, SpawnRequest, WorkerSpec

_SPAWN_REPLY_TIMEOUT_S = 120.0


class WorkerProcess(Protocol):
    """A started worker: enough to wait for it, signal it and learn its exit code."""

    @property
    def pid(self) -> int: ...

    def exited(self) -> bool:
        """Whether the process has ended (without blocking)."""
        ...

    def wait(self, timeout: float) -> int | None:
        """Exit code (``None`` if unknowable); raises ``subprocess.TimeoutExpired``."""
        ...


class _Subprocess:
    """A worker started with ``subprocess.Popen``."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc

    @property
    def pid(self) -> int:
        return self._proc.pid

    def exited(self) -> bool:
        return self._proc.poll() is not None

    def wait(self, timeout: float) -> int | None:
        return self._proc.wait(timeout=timeout)


class _ForkedWorker:
    """A worker forked by the fork server, which reports its exit code."""

    def __init__(self, server: _ForkServer, pid: int) -> None:
        self._server = server
        self._pid = pid

    @property
    def pid(self) -> int:
        return self._pid

    def exited(self) -> bool:
        return self._server.exit_code(self._pid, 0.0) is not _RUNNING

    def wait(self, timeout: float) -> int | None:
        code = self._server.exit_code(self._pid, timeout)
        if code is _RUNNING:
            raise subprocess.TimeoutExpired(f"worker {self._pid}", timeout)
        return code  # type: ignore[return-value]


_RUNNING = object()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class _ForkServer:
    """Parent-side handle of the fork server process."""

    def __init__(self, env: dict[str, str], log_path: str) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with theirs, open(log_path, "wb") as log:
            self._proc = subprocess.Popen(
                [
                    *(sys.executable, "-m", "ds_testing._forkserver"),
                    *("--fd", str(theirs.fileno()), "--parent-pid", str(os.getpid())),
                    *("--preload", ",".join(_preload)),
                ],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.log_path = log_path
        self._sock = ours
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._spawned: dict[int, int] = {}
        self._exits: dict[int, int] = {}
        self._alive = True
        self._next_id = 0
        threading.Thread(
            target=self._read_replies, name="ds-testing-forkserver", daemon=True
        ).start()

    @property
    def alive(self) -> bool:
        return self._alive

    def _read_replies(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            with self._cond:
                if not data:
                    self._alive = False
                    self._cond.notify_all()
                    return
                message = pickle.loads(data)
                if isinstance(message, Spawned):
                    self._spawned[message.request_id] = message.pid
                elif isinstance(message, Exited):
                    self._exits[message.pid] = message.code
                self._cond.notify_all()

    def spawn(self, spec: WorkerSpec, fd: int, env: dict[str, str], log_path: str) -> _ForkedWorker:
        """Fork a worker that serves ``spec`` on the socket ``fd`` (raises if the server is gone)."""
        with self._cond:
            request_id = self._next_id
            self._next_id += 1
        request = SpawnRequest(request_id, spec, env, log_path, os.getcwd())
        with self._send_lock:
            socket.send_fds(self._sock, [pickle.dumps(request)], [fd])
        with self._cond:
            self._cond.wait_for(
                lambda: request_id in self._spawned or not self._alive, _SPAWN_REPLY_TIMEOUT_S
            )
            if request_id not in self._spawned:
                raise RuntimeError(f"the fork server did not start a worker (log: {self.log_path})")
            return _ForkedWorker(self, self._spawned.pop(request_id))

    def exit_code(self, pid: int, timeout: float) -> object:
        """``pid``'s exit code, ``None`` if it ended unreported, or ``_RUNNING`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if pid in self._exits:
                    return self._exits[pid]
                if not self._alive and _gone(pid):
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return _RUNNING
                self._cond.wait(min(remaining, 0.1))

    def close(self) -> None:
        """Close the socket; the server kills its remaining workers and exits."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


_server_lock = threading.Lock()
_server: _ForkServer | None = None
_server_failed = False
_preload: tuple[str, ...] = ()


def set_preload(modules: tuple[str, ...]) -> None:
    """Modules the fork server imports before forking (see [Note: Fork server]); not while one
    runs, since its workers have forked from what it had imported."""
    global _preload
    with _server_lock:
        if _server is not None and modules != _preload:
            raise RuntimeError(
                f"ds_testing.preload{modules!r} while the fork server runs (with"
                f" {_preload!r}): call it from the suite's conftest.py, before any run_on_ranks"
            )
        _preload = modules


def _fork_server(env: dict[str, str]) -> _ForkServer | None:
    """The running fork server, started on first use; ``None`` if disabled or broken."""
    global _server, _server_failed
    with _server_lock:
        if _server is not None and not _server.alive:
            _server, _server_failed = None, True
        if _server is None and not _server_failed:
            if os.environ.get("DS_TESTING_FORK_SERVER", "1") == "0":
                _server_failed = True
            else:
                log_dir = tempfile.mkdtemp(prefix="ds-testing-forkserver-")
                _server = _ForkServer(env, os.path.join(log_dir, "forkserver.log"))
        return _server


def stop_fork_server() -> None:
    """Stop the fork server (if any); the next launch starts a new one."""
    global _server, _server_failed
    with _server_lock:
        server, _server, _server_failed = _server, None, False
    if server is not None:
        server.close()
        shutil.rmtree(os.path.dirname(server.log_path), ignore_errors=True)


def launch_worker(spec: WorkerSpec, fd: int, env: dict[str, str], log_path: str) -> WorkerProcess:
    """Start the worker for ``spec``, serving its parent on socket ``fd``; ``env`` is its environ.

    Output (stdout and stderr) goes to ``log_path``.
    """
    server = _fork_server(env)
    if server is not None:
        try:
            return server.spawn(spec, fd, env, log_path)
        except (OSError, RuntimeError) as exc:
            print(
                f"ds-testing: fork server failed ({exc}); starting workers directly",
                file=sys.stderr,
            )
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "ds_testing._worker", "--fd", str(fd)),
                *("--spec", json.dumps(asdict(spec)), "--parent-pid", str(os.getpid())),
            ],
            pass_fds=[fd],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    return _Subprocess(proc)
