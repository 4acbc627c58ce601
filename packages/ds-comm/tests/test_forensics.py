"""Hang forensics (watchdog diagnosis, timeout translation, exit) and the debug fingerprint check."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ds_comm
from ds_comm import _forensics
from ds_comm._instrument import TRACKER, group_ranks
from ds_comm.api import CollectiveMismatchError, CollectiveTimeoutError
from ds_testing import run_on_ranks

# --- the sentence (pure logic) ------------------------------------------------------------------


def test_sentence_merges_ranks_into_ranges_odd_one_first_unresponsive_last() -> None:
    phrases = {r: "in reduce_scatter #1042 (layers.7.attn)" for r in (0, 1, 2, 4, 5)}
    phrases[3] = "in all_gather #1042 (layers.7.mlp)"
    assert _forensics.describe_ranks(phrases, range(7)) == (
        "rank 3 is in all_gather #1042 (layers.7.mlp) while ranks 0-2, 4-5 are in "
        "reduce_scatter #1042 (layers.7.attn) and rank 6 is unresponsive"
    )


def test_sentence_with_three_states_and_one_state() -> None:
    phrases = {0: "in barrier #2 (a.py:1)", 1: "not in a collective (last: barrier #1 (a.py:1))"}
    assert _forensics.describe_ranks(phrases, range(4)) == (
        "rank 0 is in barrier #2 (a.py:1) while rank 1 is not in a collective "
        "(last: barrier #1 (a.py:1)) and ranks 2-3 are unresponsive"
    )
    assert _forensics.describe_ranks({0: "in x #1 (y)", 1: "in x #1 (y)"}, [0, 1]) == (
        "ranks 0-1 are in x #1 (y)"
    )


# --- hang diagnosis on real (gloo) hangs --------------------------------------------------------


def _diverge_body(
    rank: int,
    world_size: int,
    *,
    odd_rank: int,
    odd: str,
    group_timeout_s: float,
    forensics_timeout_s: float | None = None,
) -> dict:
    """All ranks do two all_reduces; then ``odd_rank`` does ``odd`` while the rest all_reduce."""
    group = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=group_timeout_s))
    _forensics.arm(forensics_timeout_s, poll_s=0.2, grace_s=2.0)
    try:
        x = torch.ones(4)
        site = "layers.7.mlp" if rank == odd_rank else "layers.7.attn"
        with ds_comm.annotate(site):
            ds_comm.all_reduce(x, group=group)
            ds_comm.all_reduce(x, group=group)
        expected_seq = TRACKER.seq[group_ranks(group)] + 1
        start = time.monotonic()
        try:
            if rank != odd_rank:
                with ds_comm.annotate(site):
                    ds_comm.all_reduce(x, group=group)
            elif odd == "all_gather_into_tensor":
                with ds_comm.annotate(site):
                    ds_comm.all_gather_into_tensor(torch.empty(4 * world_size), x, group=group)
            elif odd == "barrier":
                with ds_comm.annotate(site):
                    ds_comm.barrier(group=group)
            else:  # "sleep": not in any collective while the others wait
                time.sleep(group_timeout_s + 3.0)
                incident = _forensics.last_incident()
                return {
                    "error": None,
                    "seq": expected_seq,
                    "own_state": incident and incident.states[rank]["phrase"],
                }
        except CollectiveTimeoutError as exc:
            assert _forensics.last_incident() is not None
            return {"error": str(exc), "elapsed": time.monotonic() - start, "seq": expected_seq}
        return {"error": None, "seq": expected_seq}
    finally:
        _forensics.disarm()


def _seqs(pattern: str, message: str) -> list[int]:
    match = re.search(pattern, message)
    assert match, f"{pattern!r} not in {message!r}"
    return [int(g) for g in match.groups()]


def test_two_ranks_in_different_collectives_both_raise_naming_both() -> None:
    results = run_on_ranks(
        _diverge_body,
        2,
        odd_rank=1,
        odd="all_gather_into_tensor",
        group_timeout_s=4.0,
        fresh=True,
        timeout=60,
    )
    for result in results:
        message = result["error"]
        assert message is not None and result["elapsed"] < 20, result
        seq = result["seq"]
        assert _seqs(r"rank 1 is in all_gather_into_tensor #(\d+) \(layers\.7\.mlp\)", message) == [
            seq
        ]
        assert _seqs(r"rank 0 is in all_reduce #(\d+) \(layers\.7\.attn\)", message) == [seq]
        assert " while " in message
    assert results[0]["error"].split(" [rank")[0] == results[1]["error"].split(" [rank")[0]


def test_rank_outside_any_collective_is_named_with_its_last_op() -> None:
    # DS_COMM_TIMEOUT below the group timeout: diagnosed at 2 s, the call still fails at 5 s.
    results = run_on_ranks(
        _diverge_body,
        2,
        odd_rank=1,
        odd="sleep",
        group_timeout_s=5.0,
        env={"DS_COMM_TIMEOUT": "2"},
        fresh=True,
        timeout=60,
    )
    waiting, sleeping = results
    seq = waiting["seq"]
    assert waiting["error"] is not None and waiting["elapsed"] < 20, waiting
    assert _seqs(r"rank 0 is in all_reduce #(\d+) \(layers\.7\.attn\)", waiting["error"]) == [seq]
    last = _seqs(
        r"rank 1 is not in a collective \(last: all_reduce #(\d+) \(layers\.7\.mlp\)\)",
        waiting["error"],
    )
    assert last == [seq - 1]
    assert sleeping["error"] is None and sleeping["own_state"].startswith("not in a collective")


def test_four_ranks_group_the_agreeing_ranks_when_the_backend_times_out_first() -> None:
    # A forensics timeout above the group timeout: the gloo timeout error starts the diagnosis.
    results = run_on_ranks(
        _diverge_body,
        4,
        odd_rank=3,
        odd="barrier",
        group_timeout_s=4.0,
        forensics_timeout_s=60.0,
        fresh=True,
        timeout=90,
    )
    for result in results:
        message, seq = result["error"], result["seq"]
        assert message is not None and result["elapsed"] < 20, result
        assert _seqs(
            r"^rank 3 is in barrier #(\d+) \(layers\.7\.mlp\) while ranks 0-2 are in "
            r"all_reduce #(\d+) \(layers\.7\.attn\)",
            message,
        ) == [seq, seq]


_NEVER_RETURNS = textwrap.dedent(
    """
    import threading
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from ds_comm import _forensics
    from ds_comm._instrument import tracked

    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=1)
    )
    _forensics.arm(poll_s=0.1, grace_s=0.5, exit_grace_s=1.0)
    # gloo always honours its timeout, so a transport that never returns (NCCL without async
    # error handling) is stood in for by a tracked call blocked on an event nobody sets.
    never = threading.Event()
    tracked("all_reduce", None, [torch.ones(1)], msg_bytes=4, algo="ring", async_op=False,
            run=never.wait)
    print("returned")
    """
)


def test_call_still_blocked_after_its_group_timeout_ends_the_process(tmp_path) -> None:
    script = tmp_path / "never_returns.py"
    script.write_text(_NEVER_RETURNS)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == _forensics.HANG_EXIT_CODE, proc.stderr
    assert "returned" not in proc.stdout
    assert "hang diagnosis: rank 0 is in all_reduce #1 (never_returns.py:" in proc.stderr
    assert "is still blocked" in proc.stderr and "exiting with code 124" in proc.stderr
    # The stack of the blocked main thread was printed, down to where it waits.
    assert "work = run()" in proc.stderr and "in wait" in proc.stderr
    assert time.monotonic() - start < 60


# --- debug mode: fingerprints checked before each collective ------------------------------------


def _debug_body(rank: int, world_size: int, *, kind: str) -> dict:
    # A short group timeout so that a broken check fails fast instead of stalling the suite.
    group = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=10))
    logger = ds_comm.get_comms_logger()
    previous = ds_comm.configure(debug=True)
    try:
        x = torch.full((4,), float(rank))
        ds_comm.all_reduce(x, group=group)  # agreeing calls pass the check and run normally
        assert torch.equal(x, torch.full((4,), float(sum(range(world_size)))))
        if kind == "agree":
            out = torch.empty(4 * world_size)
            ds_comm.all_gather_into_tensor(out, x, group=group)
            assert torch.equal(out, x.repeat(world_size))
            return {"error": None}
        start = time.monotonic()
        try:
            if kind == "op" and rank == world_size - 1:
                ds_comm.all_gather_into_tensor(torch.empty(4 * world_size), x, group=group)
            elif kind == "op":
                ds_comm.all_reduce(x, group=group)
            else:  # "shape": the same op on different shapes
                ds_comm.all_reduce(torch.ones(4 if rank == 0 else 8), group=group)
        except CollectiveMismatchError as exc:
            return {
                "error": str(exc),
                "elapsed": time.monotonic() - start,
                "in_flight": len(TRACKER.in_flight),
                "x": x.tolist(),
                "seq": TRACKER.seq[group_ranks(group)],
            }
        return {"error": None}
    finally:
        ds_comm.configure(previous)
        assert logger.config == previous


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_debug_check_passes_when_ranks_agree(world_size: int) -> None:
    assert run_on_ranks(_debug_body, world_size, kind="agree") == [{"error": None}] * world_size


def test_debug_check_catches_different_ops_before_issuing_them() -> None:
    results = run_on_ranks(_debug_body, 2, kind="op")
    assert results[0]["error"] == results[1]["error"]  # every rank raises the same sentence
    message, seq = results[0]["error"], results[0]["seq"]
    assert f"rank 1 is in all_gather_into_tensor #{seq} " in message
    assert f"rank 0 is in all_reduce #{seq} " in message
    assert "the op was not issued" in message
    for result in results:
        assert result["elapsed"] < 5 and result["in_flight"] == 0
        assert result["x"] == [1.0] * 4  # rank 0's all_reduce did not run


def test_debug_check_catches_different_shapes_of_the_same_op() -> None:
    results = run_on_ranks(_debug_body, 2, kind="shape")
    message = results[0]["error"]
    assert message == results[1]["error"]
    assert re.search(r"rank 0 is in all_reduce #\d+ \(.*\) on float32 \[4\]", message), message
    assert re.search(r"rank 1 is in all_reduce #\d+ \(.*\) on float32 \[8\]", message), message


def _arm_body(rank: int, world_size: int) -> tuple[list[str], int]:
    import threading

    from ds_comm.api import ConfigError

    def watchdogs() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name == "ds_comm-hang-watchdog"]

    with pytest.raises(ConfigError, match="DS_COMM_TIMEOUT='soon'"):
        os.environ["DS_COMM_TIMEOUT"] = "soon"
        try:
            _forensics.arm()
        finally:
            del os.environ["DS_COMM_TIMEOUT"]
    with pytest.raises(ConfigError, match="poll_s"):
        _forensics.arm(poll_s=0)
    _forensics.arm(poll_s=0.05)
    _forensics.arm(poll_s=0.05)  # re-arming replaces the watchdog rather than adding one
    armed = watchdogs()
    x = torch.ones(2)
    ds_comm.all_reduce(x)  # an idle armed rank diagnoses nothing
    time.sleep(0.2)
    assert _forensics.last_incident() is None
    generation = _forensics._WATCHDOG.gen  # store keys of this arm; must agree across ranks
    _forensics.disarm()
    return armed + watchdogs(), generation


def test_arm_validates_and_disarm_stops_the_watchdog() -> None:
    results = run_on_ranks(_arm_body, 2)
    assert [threads for threads, _ in results] == [["ds_comm-hang-watchdog"]] * 2
    assert results[0][1] == results[1][1]
