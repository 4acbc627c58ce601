"""The C kernels' thread pool under fork() and concurrent callers ([Note: thread pool])."""

from __future__ import annotations

import multiprocessing
import threading
from multiprocessing.connection import Connection

import pytest
import torch

import ds_native

N = 4 * 32768 + 3  # several chunks, so every thread gets work


def _state(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(N, generator=gen),
        torch.randn(N, generator=gen),
        torch.zeros(N),
        torch.zeros(N),
    ]


def _steps(tensors: list[torch.Tensor], num_threads: int, steps: int = 5) -> None:
    for step in range(1, steps + 1):
        ds_native.adam_step(*tensors, step=step, lr=1e-3, num_threads=num_threads)


def _child(conn: Connection) -> None:
    tensors = _state(1)
    _steps(tensors, num_threads=3)
    conn.send([t.tolist()[:100] for t in tensors])
    conn.close()


@pytest.mark.skipif(
    "fork" not in multiprocessing.get_all_start_methods(), reason="needs fork() (POSIX)"
)
def test_pool_works_in_a_forked_child() -> None:
    _steps(_state(0), num_threads=3)  # the parent's pool has started its workers
    expected = _state(1)
    _steps(expected, num_threads=1)

    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(child_end,))
    child.start()
    child_end.close()
    try:
        assert parent_end.poll(120), "the forked child hung in the thread pool"
        got = parent_end.recv()
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    assert got == [t.tolist()[:100] for t in expected]
    _steps(_state(0), num_threads=3)  # and the parent's pool still works


def test_concurrent_callers_get_correct_results() -> None:
    # cffi releases the GIL: several Python threads call in at once; those that find the pool
    # busy run their loop on their own thread.
    expected = [_state(seed) for seed in range(4)]
    for tensors in expected:
        _steps(tensors, num_threads=1)
    got = [_state(seed) for seed in range(4)]
    errors: list[BaseException] = []

    def run(tensors: list[torch.Tensor]) -> None:
        try:
            _steps(tensors, num_threads=2, steps=5)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert not any(t.is_alive() for t in threads)
    for a, b in zip(got, expected):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
