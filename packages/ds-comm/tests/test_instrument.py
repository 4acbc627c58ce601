"""The tracked path's records (see [Note: cheap tracking]): lazy fingerprints, sequence numbers,
and a hung point-to-point call still reported with its rank and op."""

from __future__ import annotations

import pickle
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import ds_comm
from ds_comm import _forensics, _instrument
from ds_comm._instrument import TRACKER, CallRecord, Fingerprint
from ds_comm.api import CollectiveTimeoutError
from ds_testing import run_on_ranks


def test_fingerprint_is_built_lazily_from_the_facts_at_issue_time() -> None:
    t = torch.zeros(2, 3, dtype=torch.bfloat16)
    rec = CallRecord("isend", 7, (0, 1), (t.shape,), t.dtype, "site.py:1", t.nbytes, "native", True)
    assert rec._fp is None  # nothing built until someone reads it
    t.resize_(5)  # the caller reusing its tensor does not change what was issued
    fp = rec.fingerprint
    assert fp == Fingerprint("isend", 7, (0, 1), ((2, 3),), "bfloat16", "site.py:1")
    assert type(fp.shapes[0]) is tuple  # plain tuples, not torch.Size
    assert rec.fingerprint is fp
    assert fp.describe() == "isend #7 (site.py:1)"
    assert pickle.loads(pickle.dumps(fp)) == fp and hash(fp) == hash(pickle.loads(pickle.dumps(fp)))
    empty = CallRecord("barrier", 1, (0,), (), None, "?", 0, "native", False)
    assert empty.fingerprint.dtype == "-" and empty.fingerprint.shapes == ()
    assert "seq=7" in repr(rec) and "blocking=False" in repr(rec)


def _seq_body(rank: int, world_size: int) -> dict:
    peer = 1 - rank
    x = torch.arange(4.0)
    seqs: list[tuple[str, int]] = []
    hook = lambda rec: seqs.append((rec.fingerprint.op, rec.fingerprint.seq))  # noqa: E731
    TRACKER.on_end.append(hook)
    try:
        ds_comm.all_reduce(x)
        if rank == 0:
            ds_comm.isend(x, peer).wait()
            ds_comm.send(x, peer)
            src = ds_comm.recv(x, None)
        else:
            ds_comm.irecv(x, peer).wait()
            ds_comm.recv(x, peer)
            ds_comm.send(x, peer)
            src = None
        ds_comm.all_reduce(x)
    finally:
        TRACKER.on_end.remove(hook)
    # Helper threads (ring algorithms) share the counters: numbering stays gapless.
    numbered: list[int] = []

    def spin() -> None:
        for _ in range(500):
            rec = _instrument.begin_one("isend", None, x, "native", True)
            _instrument.end(rec)
            numbered.append(rec.seq)

    threads = [threading.Thread(target=spin) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {
        "seqs": seqs,
        "src": src,
        "numbered": sorted(numbered),
        "flying": len(TRACKER.in_flight),
    }


def test_p2p_calls_count_apart_from_collectives_and_threads_number_gaplessly() -> None:
    for rank, result in enumerate(run_on_ranks(_seq_body, 2, fresh=True)):
        ops = ["all_reduce", "isend", "send", "recv", "all_reduce"]
        if rank == 1:
            ops[1:4] = ["irecv", "recv", "send"]
        assert result["seqs"] == list(zip(ops, [1, 1, 2, 3, 2])), result["seqs"]
        assert result["src"] == (1 if rank == 0 else None)  # recv from any rank names the sender
        assert result["numbered"] == list(range(4, 2004))
        assert result["flying"] == 0


def _p2p_hang_body(rank: int, world_size: int) -> dict:
    """Both ranks receive from each other: a p2p deadlock the diagnosis must name."""
    group = dist.new_group([0, 1], timeout=timedelta(seconds=4.0))
    _forensics.arm(None, poll_s=0.2, grace_s=2.0)
    x = torch.zeros(4)
    start = time.monotonic()
    try:
        with ds_comm.annotate(f"stage{rank}"):
            if rank == 0:
                ds_comm.irecv(x, 1, group=group).wait()
            else:
                ds_comm.recv(x, 0, group=group)
    except CollectiveTimeoutError as exc:
        return {"error": str(exc), "elapsed": time.monotonic() - start}
    finally:
        _forensics.disarm()
    return {"error": None}


def test_hung_p2p_call_is_reported_with_rank_and_op() -> None:
    results = run_on_ranks(_p2p_hang_body, 2, fresh=True, timeout=60)
    for result in results:
        message = result["error"]
        assert message is not None and result["elapsed"] < 20, result
        assert "rank 0 is in irecv #1 (stage0)" in message, message
        assert "rank 1 is in recv #1 (stage1)" in message, message
