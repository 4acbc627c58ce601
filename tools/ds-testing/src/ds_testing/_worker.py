"""Main loop of one rank's worker process (forked by the fork server, or started on its own).

Start-up imports torch and (unless disabled) joins the default process group, then answers
``Ready``. Each ``Call`` runs ``fn(rank, world_size, *args, **kwargs)`` and answers ``Done`` or
``Failed``. The worker exits on ``Shutdown``, on EOF of its socket, or when its parent dies.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

from ds_testing._loader import resolve
from ds_testing._protocol import Call, Done, Failed, Ready, Shutdown, WorkerSpec

_PARENT_POLL_S = 1.0


def _exit_when_orphaned(parent_pid: int) -> None:
    """Kill this worker once its parent is gone, even if the body hangs (no orphaned ranks)."""
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(70)


def _extend_sys_path() -> None:
    """Append the parent's ``sys.path`` entries (e.g. rootdir inserts made by pytest)."""
    for entry in json.loads(os.environ.get("DS_TESTING_SYS_PATH", "[]")):
        if entry not in sys.path:
            sys.path.append(entry)


def _ensure_default_group(spec: WorkerSpec, store_path: str) -> None:
    """Join the default process group unless it is still initialised (a body may destroy it)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "nccl" in spec.backend and torch.cuda.is_available():
        torch.cuda.set_device(spec.rank % torch.cuda.device_count())
    dist.init_process_group(
        spec.backend,
        init_method=f"file://{store_path}",
        rank=spec.rank,
        world_size=spec.world_size,
    )


def _destroy_leftover_group() -> None:
    """With ``init_process_group=False`` a body owns the group; drop what it left behind."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@contextmanager
def _call_env(env: dict[str, str]) -> Iterator[None]:
    """Set ``env`` for one call and restore the previous environment (and torch threads)."""
    import torch

    saved = {key: os.environ.get(key) for key in env}
    threads = torch.get_num_threads()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        torch.set_num_threads(threads)


def _run_call(spec: WorkerSpec, call: Call) -> Done | Failed:
    try:
        with _call_env(call.env):
            if spec.init_process_group:
                _ensure_default_group(spec, call.store_path)
            fn = resolve(call.module_name, call.module_path, call.qualname)
            args, kwargs = pickle.loads(call.payload)
            value = fn(spec.rank, spec.world_size, *args, **kwargs)
            if not spec.init_process_group:
                _destroy_leftover_group()
    except BaseException:
        return Failed(spec.rank, traceback.format_exc())
    try:
        return Done(spec.rank, pickle.dumps(value))
    except Exception:
        return Failed(spec.rank, f"the return value is not picklable:\n{traceback.format_exc()}")


def _start(spec: WorkerSpec) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if spec.init_process_group:
        _ensure_default_group(spec, spec.store_path)


def _send(conn: Connection, message: Any) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send_bytes(pickle.dumps(message))


def serve(spec: WorkerSpec, fd: int, parent_pid: int) -> int:
    """Serve calls for one rank on the connection ``fd`` until shut down; return the exit code."""
    conn = Connection(fd)
    stack_file = open(spec.stack_path, "w")  # noqa: SIM115 - faulthandler keeps the fd for life
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    _extend_sys_path()
    try:
        _start(spec)
    except BaseException:
        _send(conn, Failed(spec.rank, f"worker start-up failed:\n{traceback.format_exc()}"))
        return 1
    _send(conn, Ready(spec.rank, os.getpid()))
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return 0
        if isinstance(message, Shutdown):
            return 0
        _send(conn, _run_call(spec, message))


def main(argv: list[str] | None = None) -> int:
    """Entry point of a worker started as its own process (no fork server)."""
    parser = argparse.ArgumentParser(prog="ds_testing._worker")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--spec", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    ns = parser.parse_args(argv)
    return serve(WorkerSpec(**json.loads(ns.spec)), ns.fd, ns.parent_pid)


if __name__ == "__main__":
    sys.exit(main())
