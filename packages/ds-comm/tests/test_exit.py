"""The exit hook of [Note: gloo workers at interpreter exit]: it sleeps out the grace period after
recent collectives, and two gloo ranks ending on a collective of a temporary exit cleanly."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap

import pytest

from ds_comm import _exit
from ds_comm._instrument import TRACKER, CallRecord


class _Clock:
    """A stand-in for ``_exit``'s ``time``: a fixed ``perf_counter`` and a ``sleep`` that records
    what it was asked for, so the tests check what the hook decides, not how long it took."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.sleeps: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)


@pytest.fixture
def clock(monkeypatch):
    saved = TRACKER.last_end, TRACKER.last
    TRACKER.last = None  # no call begun, unless a test says so
    fake = _Clock(now=1000.0)
    monkeypatch.setattr(_exit, "time", fake)
    yield fake
    TRACKER.last_end, TRACKER.last = saved


def test_sleeps_out_the_grace_after_a_recent_collective(clock) -> None:
    TRACKER.last_end = clock.now - 0.05
    assert _exit.settle_workers(0.2) == pytest.approx(0.15)
    assert clock.sleeps == [pytest.approx(0.15)]


def test_costs_nothing_long_after_the_last_collective(clock) -> None:
    TRACKER.last_end = clock.now - 5.0
    assert _exit.settle_workers(0.2) == 0.0
    assert clock.sleeps == []


def test_a_call_never_waited_counts_from_its_start(clock) -> None:
    TRACKER.last_end = float("-inf")  # nothing has completed
    rec = CallRecord("all_reduce", 1, (0,), ((4,),), None, "site.py:1", 16, "native", True)
    rec.start = clock.now - 0.1
    TRACKER.last = rec  # begun, never waited
    assert _exit.settle_workers(0.2) == pytest.approx(0.1)
    rec.start -= 5.0
    assert _exit.settle_workers(0.2) == 0.0
    assert clock.sleeps == [pytest.approx(0.1)]


def test_importing_ds_comm_registers_the_hook() -> None:
    # Run the interpreter's exit functions with a recording clock: the hook asks for the grace.
    code = (
        "import atexit, ds_comm\n"
        "from ds_comm import _exit\n"
        "from ds_comm._instrument import TRACKER\n"
        "asked = []\n"
        "class Clock:\n"
        "    perf_counter = staticmethod(lambda: 1000.0)\n"
        "    sleep = staticmethod(asked.append)\n"
        "_exit.time = Clock\n"
        "TRACKER.last_end = 1000.0  # as if a collective just ended\n"
        "atexit._run_exitfuncs()\n"
        "print(asked)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert ast.literal_eval(proc.stdout.strip()) == [pytest.approx(_exit.EXIT_GRACE_S)]


_ENDS_ON_A_TEMPORARY = textwrap.dedent(
    """
    import sys
    import tempfile

    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    import ds_comm


    def rank_fn(rank, rendezvous):
        dist.init_process_group(
            "gloo", init_method=f"file://{rendezvous}/rdzv", rank=rank, world_size=2
        )
        ds_comm.all_reduce(torch.ones(1 << 20))  # a temporary, dropped as the call returns


    if __name__ == "__main__":
        with tempfile.TemporaryDirectory() as rendezvous:
            mp.spawn(rank_fn, args=(rendezvous,), nprocs=2)
        print("clean exit")
    """
)


# Without the hook this script aborted (SIGABRT, "terminate called without an active exception")
# in 3 of 8 runs on the development machine; with it, in none of 26. Each run starts two
# processes that import torch (about 10 s on 2 cores), so the default run tries once and the slow
# tier tries eight times, enough to catch a regression with high probability.
@pytest.mark.parametrize("attempts", [1, pytest.param(8, marks=pytest.mark.slow)])
def test_ranks_ending_on_a_collective_of_a_temporary_exit_cleanly(tmp_path, attempts: int) -> None:
    script = tmp_path / "ends_on_a_temporary.py"
    script.write_text(_ENDS_ON_A_TEMPORARY)
    for attempt in range(attempts):
        proc = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert proc.returncode == 0 and "clean exit" in proc.stdout, (attempt, proc.stderr)
        assert "terminate called" not in proc.stderr
