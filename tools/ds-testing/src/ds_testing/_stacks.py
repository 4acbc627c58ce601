"""Dump the Python stacks of running workers (for hang reports).

Each worker registers ``faulthandler`` on SIGUSR1 writing to its own stack file. faulthandler's
handler is a C signal handler, so it writes even while the main thread is blocked inside a gloo
collective or ``time.sleep`` and never runs Python code.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Mapping

_DUMP_WAIT_S = 2.0
_POLL_S = 0.05


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def dump_stacks(pids: Mapping[int, int], stack_paths: Mapping[int, str]) -> dict[int, str]:
    """Signal each rank's worker (``rank -> pid``) and return ``rank -> stack text``.

    Waits up to ~2 s for the dumps to appear; a rank whose dump never appears maps to a short note.
    """
    before = {rank: _size(stack_paths[rank]) for rank in pids}
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + _DUMP_WAIT_S
    last = dict(before)
    while time.monotonic() < deadline:
        time.sleep(_POLL_S * 2)
        sizes = {rank: _size(stack_paths[rank]) for rank in pids}
        # Done when every dump has started and none grew since the last poll.
        if all(sizes[r] > before[r] for r in pids) and sizes == last:
            break
        last = sizes
    stacks: dict[int, str] = {}
    for rank in pids:
        try:
            with open(stack_paths[rank], "rb") as f:
                f.seek(before[rank])
                text = f.read().decode("utf-8", "replace").strip()
        except OSError:
            text = ""
        stacks[rank] = text or "(no stack dump received)"
    return stacks
