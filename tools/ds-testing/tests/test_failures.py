"""How ``run_on_ranks`` reports ranks that raise, hang or die, and that it recovers afterwards."""

from __future__ import annotations

import os
import time

import pytest

from ds_testing import DistributedTestFailure, run_on_ranks


def _raise_on_rank_one(rank: int, world_size: int) -> int:
    print(f"rank {rank} says hi before failing")
    if rank == 1:
        _helper_that_raises()
    return rank


def _helper_that_raises() -> None:
    raise ValueError("boom from the helper")


def _pid_body(rank: int, world_size: int) -> int:
    return os.getpid()


def test_exception_on_one_rank_reports_its_traceback() -> None:
    before = run_on_ranks(_pid_body, 2)
    with pytest.raises(DistributedTestFailure) as info:
        run_on_ranks(_raise_on_rank_one, 2, timeout=30)
    message = str(info.value)
    assert "ranks [1] raised" in message
    assert "ranks [0] succeeded" in message
    assert "rank 1 traceback" in message
    assert "_helper_that_raises" in message and "ValueError: boom from the helper" in message
    assert "rank 1 says hi before failing" in message  # the failed rank's output tail
    # The failed pool was replaced by fresh workers.
    after = run_on_ranks(_pid_body, 2)
    assert set(after).isdisjoint(before)


def _raise_on_every_rank(rank: int, world_size: int) -> None:
    raise RuntimeError(f"rank {rank} is broken")


def test_every_failed_rank_is_reported() -> None:
    with pytest.raises(DistributedTestFailure) as info:
        run_on_ranks(_raise_on_every_rank, 2, timeout=30)
    message = str(info.value)
    assert "ranks [0, 1] raised" in message and "no rank succeeded" in message
    assert "RuntimeError: rank 0 is broken" in message
    assert "RuntimeError: rank 1 is broken" in message


def _hang_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        _sleep_forever()
    return rank


def _sleep_forever() -> None:
    time.sleep(3600)


def test_hang_is_reported_with_stack_within_timeout() -> None:
    run_on_ranks(_pid_body, 2)  # start-up is not part of the timeout; keep it out of the timing
    start = time.monotonic()
    with pytest.raises(DistributedTestFailure) as info:
        run_on_ranks(_hang_on_rank_one, 2, timeout=5)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "ranks [1] did not finish within 5.0 s" in message
    assert "ranks [0] succeeded" in message
    assert "rank 1 stack (hung)" in message
    assert "_sleep_forever" in message and "_hang_on_rank_one" in message
    assert elapsed < 15


def _barrier_skipped_by_rank_zero(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    if rank == 0:
        raise KeyError("rank 0 skipped the barrier")
    dist.barrier()


def test_victim_waiting_in_collective_is_reported_after_grace() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestFailure) as info:
        run_on_ranks(_barrier_skipped_by_rank_zero, 2, timeout=60)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "KeyError: 'rank 0 skipped the barrier'" in message
    assert "ranks [1] did not finish within 5.0 s after rank 0 failed" in message
    assert "_barrier_skipped_by_rank_zero" in message  # rank 1's stack
    assert elapsed < 30


def _exit_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        os._exit(3)
    return rank


def test_crash_is_reported_with_exit_code() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestFailure) as info:
        run_on_ranks(_exit_on_rank_one, 2, timeout=60)
    assert "rank 1 exited with code 3" in str(info.value)
    assert time.monotonic() - start < 30
    assert run_on_ranks(_exit_on_rank_one, 1) == [0]


def _unpicklable_result(rank: int, world_size: int) -> object:
    return lambda: None


def test_unpicklable_result_is_reported() -> None:
    with pytest.raises(DistributedTestFailure, match="not picklable"):
        run_on_ranks(_unpicklable_result, 1)
