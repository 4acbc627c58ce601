"""The checksum threads: created without waiting for them to start, running jobs as an executor
does (see ds-zero's [Note: starting the checksum threads])."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest

from ds_zero import _read_checks
from ds_zero._workers import Workers


@pytest.fixture
def gated_thread_start(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """``threading.Thread.start`` held until the returned event is set: a thread that is slow
    to come up, as on a loaded machine."""
    gate = threading.Event()
    start = threading.Thread.start

    def held_start(thread: threading.Thread) -> None:
        if thread.name.startswith("ds-verify"):
            assert gate.wait(30), "the test never opened the gate"
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", held_start)
    return gate


def test_the_first_load_does_not_wait_for_the_checksum_threads_to_start(
    gated_thread_start: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader's thread creates the pool and queues a job while no thread has started, and
    goes on; the job runs once the threads are up."""
    monkeypatch.setattr(_read_checks, "_POOLS", {})  # a first load of this process
    returned = threading.Event()
    jobs = []

    def first_load() -> None:
        pool = _read_checks.HelpedPool(2)
        jobs.append(pool.submit(lambda: 6 * 7))
        returned.set()

    loader = threading.Thread(target=first_load)
    loader.start()
    assert returned.wait(10), "creating the pool waited for its threads to start"
    assert not jobs[0].done()  # no thread is up yet
    gated_thread_start.set()
    assert jobs[0].result(timeout=10) == 42
    loader.join(10)
    pool = _read_checks.HelpedPool(2)  # the same threads, both up: two jobs run at once
    both, free = threading.Barrier(3), threading.Event()
    held = [pool.submit(lambda: (both.wait(10), free.wait(10))) for _ in range(2)]
    both.wait(10)
    free.set()
    for job in held:
        job.result(timeout=10)


def test_jobs_run_in_order_on_named_threads_and_raise_where_their_result_is_asked() -> None:
    workers = Workers(1, "ds-verify-test")
    ran_on = workers.submit(lambda: threading.current_thread().name)
    order: list[int] = []
    jobs = [workers.submit(order.append, i) for i in range(5)]
    failed = workers.submit(lambda: 1 // 0)
    assert ran_on.result(timeout=10) == "ds-verify-test_0"
    with pytest.raises(ZeroDivisionError):
        failed.result(timeout=10)
    assert all(job.done() for job in jobs) and order == list(range(5))


def test_a_job_cancelled_before_a_thread_takes_it_never_runs() -> None:
    workers = Workers(1, "ds-verify-test")
    busy, free = threading.Event(), threading.Event()
    held = workers.submit(lambda: (busy.set(), free.wait(10)))
    assert busy.wait(10)
    ran = threading.Event()
    queued = workers.submit(ran.set)
    assert not held.cancel()  # started: too late
    assert queued.cancel()
    after = workers.submit(lambda: "next")
    free.set()
    assert after.result(timeout=10) == "next"
    assert not ran.is_set()
    with pytest.raises(CancelledError):
        queued.result()
