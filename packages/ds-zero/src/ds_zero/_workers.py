"""Worker threads whose start-up the caller does not wait for.

[Note: starting the checksum threads]
``threading.Thread.start`` returns only once the new thread runs, which on the 2-core
development VM takes about 0.35 ms a thread: starting two checksum threads cost a job's first
checkpoint load about 0.8 ms of a 23 ms weights-only load, and starting eight (a 16-core host)
would cost about 3 ms, all of it on the loader's path before the first checksum begins. So
:class:`Workers` hands the threads to a starter thread made with ``_thread.start_new_thread``,
which returns at once (about 35 us): the loader goes on reading while the threads come up, and
the jobs it submits meanwhile wait in the queue (or are taken over by the loader, see
:class:`~ds_zero._read_checks.HelpedPool`). The workers are ordinary daemon
``threading.Thread`` s; a job is a ``concurrent.futures.Future`` that, as in
``ThreadPoolExecutor``, can be cancelled until a worker starts it.
"""

from __future__ import annotations

import _thread
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

__all__ = ["Workers"]


class Workers:
    """``count`` daemon threads named ``<name>_<i>``, running submitted jobs in order; started
    in the background, so creating them does not wait for them to run."""

    def __init__(self, count: int, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]]
        self._jobs = queue.SimpleQueue()
        threads = [
            threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
            for i in range(count)
        ]
        _thread.start_new_thread(_start_all, (threads,))

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """``fn(*args)`` on a worker; the returned job can be cancelled until one starts it."""
        job: Future[Any] = Future()
        self._jobs.put((job, fn, args))
        return job

    def _work(self) -> None:
        while True:
            job, fn, args = self._jobs.get()
            if job.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except BaseException as exc:  # the job's caller sees it, as in ThreadPoolExecutor
                    job.set_exception(exc)
                else:
                    job.set_result(result)
                    del result
            del job, fn, args  # let go of the arguments before waiting for the next job


def _start_all(threads: Sequence[threading.Thread]) -> None:
    for thread in threads:
        thread.start()
