"""At interpreter exit, stops ds-comm's hang watchdog thread and lets torch's gloo worker threads
finish with the GIL, before finalization (which ends any thread that then asks for the GIL).

[Note: gloo workers at interpreter exit]
A gloo collective runs on one of its process group's C++ worker threads, which keeps the op's
tensors until it ends its loop iteration, a little after ``wait()`` has returned. If Python drops
its last reference to such a tensor first (a temporary: ``all_reduce(torch.ones(n))``), torch
keeps the tensor's Python object alive for the C++ reference (PyObject preservation), so the
worker's release of the tensor needs the GIL. While the main thread runs Python the worker waits
for the GIL; if the main thread reaches interpreter finalization meanwhile, the worker's request
ends its thread (``pthread_exit``) inside a C++ destructor and the process aborts: "terminate
called without an active exception", SIGABRT, after a run that did all of its work. With plain
torch on the development machine, two gloo ranks ending with a waited ``all_reduce`` of a
temporary aborted at exit in 4 of 6 runs; through ds-comm, 3 of 6 (upstream: pytorch/pytorch
issue 190489; torch's own exit hook, PR 179291, was abandoned). ``destroy_process_group()`` does
not cover it: the group object, and its worker threads, live on while anything (an optimizer, a
model wrapper) still references it.

[Note: the hang watchdog at interpreter exit]
The same finalization rule killed a Python thread: ds-comm's hang watchdog (``_forensics``), a
daemon thread that asks the c10d store for a trigger key once per poll period. The store call
releases the GIL; when it returns during finalization, the thread's GIL request ends it with
``pthread_exit`` inside pybind11's call wrapper, and the forced unwind through it aborts the
process the same way. The window is widest on a rank whose store server (rank 0) has already
exited: the client's call then waits on a dead connection while the main thread finalizes. A core
of the intermittent abort at the end of the accelerate ZeRO-3 client test showed exactly that
thread (``take_gil`` -> ``pthread_exit`` under ``c10d::Store::check``); a 2-rank script polling
every 2 ms aborted in 1 of 3 runs. So ds-comm's exit hook stops the watchdog and joins its thread
(``_forensics.disarm``) before finalization: no thread of ds-comm's is inside a store call then.

So ds-comm also registers the workers' hook: when a collective began or ended less than ``EXIT_GRACE_S``
ago (a call never waited has begun only), it sleeps out the rest of that time. The sleep releases the GIL, the
waiting worker takes it, releases the tensor and goes idle, and finalization finds no worker
waiting. An exit long after the last collective pays nothing.
"""

from __future__ import annotations

import atexit
import time

from ds_comm._instrument import TRACKER

EXIT_GRACE_S = 0.05


def settle_workers(grace_s: float = EXIT_GRACE_S) -> float:
    """Sleeps until ``grace_s`` after the latest collective activity; returns the seconds slept."""
    last = TRACKER.last  # the latest call to begin: no call in flight began after it
    latest = max(TRACKER.last_end, last.start if last is not None else float("-inf"))
    remaining = latest + grace_s - time.perf_counter()
    if remaining <= 0:
        return 0.0
    time.sleep(remaining)
    return remaining


def stop_watchdog() -> bool:
    """Stops and joins the hang watchdog thread, if armed (see [Note: the hang watchdog at
    interpreter exit]); returns whether one was running."""
    from ds_comm import _forensics  # imported here: _forensics imports most of ds-comm

    armed = _forensics._WATCHDOG is not None
    _forensics.disarm()
    return armed


# Run in reverse order of registration: the watchdog stops first, then the workers settle.
atexit.register(settle_workers)
atexit.register(stop_watchdog)
