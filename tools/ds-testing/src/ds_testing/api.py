"""Public API of ds-testing: run a module-level test body on N ranks and collect the results."""

from __future__ import annotations

import functools
import os
import pickle
import sys
from collections.abc import Callable
from typing import Any

from ds_testing._config import default_timeout
from ds_testing._launch import set_preload
from ds_testing._pool import PoolKey, acquire_pool, release_pool
from ds_testing._protocol import Call
from ds_testing._report import format_failure, forward_output


class DistributedTestFailure(AssertionError):
    """One or more ranks raised, died or hung; the message has every failed rank's report.

    Subclasses ``AssertionError`` so pytest reports the test as failed (not errored).
    """


@functools.cache
def gpu_count() -> int:
    """Number of visible CUDA devices (0 without CUDA); cached, creates no CUDA context."""
    import torch

    return torch.cuda.device_count()


def preload(*modules: str) -> None:
    """Import ``modules`` once in the fork server, before it forks the rank workers, instead of
    in every worker: for a suite whose every worker imports something slow. Call it from the
    suite's ``conftest.py``; while the fork server runs, a different list raises
    ``RuntimeError``.

    Example: the first ``torch.optim.Optimizer`` a process builds imports ``torch._dynamo``
    (2.5 s of each worker's start on a 2-core machine), so a suite that builds optimizers calls
    ``preload("torch._dynamo")``.
    """
    set_preload(tuple(modules))


def _resolve_backend(backend: str) -> str:
    """``nccl`` needs GPUs; without them the group falls back to gloo."""
    if "nccl" in backend and gpu_count() == 0:
        return "gloo"
    return backend


def _locate(fn: Callable[..., Any]) -> tuple[str, str, str]:
    """``(module name, module file, qualname)`` of a module-level function."""
    qualname = getattr(fn, "__qualname__", "")
    if not qualname or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(f"run_on_ranks needs a module-level function, got {fn!r}")
    module = sys.modules.get(fn.__module__)
    path = getattr(module, "__file__", None)
    if not path:
        raise ValueError(f"cannot find the source file of {fn.__module__!r} (defining {qualname})")
    return fn.__module__, os.path.abspath(path), qualname


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float | None = None,
    backend: str = "gloo",
    init_process_group: bool = True,
    fresh: bool = False,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` worker processes.

    Workers are reused across calls with the same ``(world_size, backend, init_process_group)``
    and are replaced after any failure. Arguments and results are pickled.

    Args:
        fn: A module-level function (loaded in the worker from its file).
        world_size: Number of ranks.
        timeout: Seconds the body may run; default ``--ds-timeout``, ``$DS_TESTING_TIMEOUT``
            or 120.
        backend: Backend of the default process group (``"nccl"`` falls back to gloo without
            GPUs; each rank then uses ``cuda:rank % gpu_count()``).
        init_process_group: If False, no group is created; the env holds ``RANK``,
            ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and a free
            ``MASTER_PORT`` for ``init_method="env://"``.
        fresh: Use one-off workers, discarded afterwards (for bodies that change global state).
        env: Extra environment variables for this call only.

    Returns:
        The return values, indexed by rank.

    Raises:
        DistributedTestFailure: A rank raised, exited or did not finish in time; the message
            holds every failed rank's traceback (or stack) and output.

    Example:
        >>> def _body(rank, world_size):
        ...     t = torch.ones(1) * rank
        ...     dist.all_reduce(t)
        ...     return t.item()
        >>> run_on_ranks(_body, 2)
        [1.0, 1.0]
    """
    __tracebackhide__ = True
    if os.environ.get("DS_TESTING_RANK_WORKER"):
        raise RuntimeError(
            "run_on_ranks was called inside a rank worker; does the body's module run code at"
            " import time? Guard it with `if __name__ == '__main__':`."
        )
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    module_name, module_path, qualname = _locate(fn)
    call = Call(
        module_name=module_name,
        module_path=module_path,
        qualname=qualname,
        payload=pickle.dumps((args, kwargs)),
        env=dict(env or {}),
    )
    timeout = default_timeout() if timeout is None else timeout
    key = PoolKey(world_size, _resolve_backend(backend), init_process_group)
    pool = acquire_pool(key, fresh=fresh)
    healthy = False
    try:
        outcome = pool.start(timeout) if not pool.started else None
        if outcome is not None:
            forward_output(outcome)
        if outcome is None or outcome.ok:
            outcome = pool.run(call, timeout)
            forward_output(outcome)
        healthy = outcome.ok
    finally:
        release_pool(pool, healthy=healthy)
    if not outcome.ok:
        raise DistributedTestFailure(format_failure(qualname, world_size, outcome))
    return [r.value for r in outcome.ranks]
