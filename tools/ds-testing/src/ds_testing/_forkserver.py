"""Fork server: imports torch once, then forks rank workers on request and reaps them.

Run as ``python -m ds_testing._forkserver --fd N --parent-pid P``; see [Note: Fork server] in
``_launch.py``. It stays single-threaded (``OMP_NUM_THREADS=1``, nothing runs before a fork), so
forking it is as safe as multiprocessing's "fork" start method with a fresh interpreter.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import pickle
import selectors
import signal
import socket
import sys
import traceback
from typing import NoReturn

from ds_testing._protocol import Exited, Spawned, SpawnRequest

MAX_MESSAGE = 1 << 20
_POLL_S = 0.1
# Imported before any fork; a suite adds its own with ds_testing.preload().
_PRELOAD = ("torch", "torch.distributed", "numpy", "pytest")


def _run_child(server: socket.socket, request: SpawnRequest, fd: int) -> NoReturn:
    """Become the worker: own session, own log, the requested environment, then serve."""
    code = 1
    try:
        server.close()
        os.setsid()
        log = os.open(request.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.chdir(request.cwd)
        os.environ.clear()
        os.environ.update(request.env)
        from ds_testing._worker import serve

        code = serve(request.spec, fd, os.getppid())
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reap(server: socket.socket, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        with contextlib.suppress(OSError):
            server.send(pickle.dumps(Exited(pid, os.waitstatus_to_exitcode(status))))


def serve(server: socket.socket, parent_pid: int) -> None:
    """Fork one worker per request until the parent goes away; then kill the workers left."""
    children: set[int] = set()
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ)
    try:
        while os.getppid() == parent_pid:
            if selector.select(_POLL_S):
                data, fds, _flags, _addr = socket.recv_fds(server, MAX_MESSAGE, 1)
                if not data:
                    return
                request: SpawnRequest = pickle.loads(data)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _run_child(server, request, fds[0])
                for fd in fds:
                    os.close(fd)
                children.add(pid)
                server.send(pickle.dumps(Spawned(request.request_id, pid)))
            _reap(server, children)
    finally:
        for pid in children:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ds_testing._forkserver")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--preload", default="", help="more modules to import, comma-separated")
    ns = parser.parse_args(argv)
    server = socket.socket(fileno=ns.fd)
    for name in (*_PRELOAD, *filter(None, ns.preload.split(","))):
        importlib.import_module(name)
    serve(server, ns.parent_pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
