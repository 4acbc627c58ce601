"""Async ops: many files in flight at once, counts from wait(), one op cut across threads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import torch

from ds_offload_aio import AioHandle

Bytes = Callable[..., torch.Tensor]


def test_many_files_in_flight(tmp_path: Path, backend: str, random_bytes: Bytes) -> None:
    sizes = [4096 * i + (i * 37) % 4096 for i in range(1, 49)]
    data = [random_bytes(n, seed) for seed, n in enumerate(sizes)]
    paths = [tmp_path / f"f{i}.bin" for i in range(len(sizes))]
    with AioHandle(32768, 8, intra_op_parallelism=4, backend=backend) as handle:  # type: ignore[arg-type]
        for tensor, path in zip(data, paths):
            assert handle.async_pwrite(tensor, path) == 0
        assert handle.wait() == len(paths)

        back = [torch.empty_like(t) for t in data]
        for tensor, path in zip(back, paths):
            assert handle.async_pread(tensor, path) == 0
        assert handle.wait() == len(paths)
        assert handle.wait() == 0  # nothing left pending
    for expected, got in zip(data, back):
        assert torch.equal(got, expected)


def test_sync_ops_do_not_wait_for_pending_async_ones(tmp_path: Path, random_bytes: Bytes) -> None:
    first, second = random_bytes(1 << 20, 1), random_bytes(12345, 2)
    with AioHandle(intra_op_parallelism=2) as handle:
        handle.async_pwrite(first, tmp_path / "a.bin")
        assert handle.sync_pwrite(second, tmp_path / "b.bin") == 1
        assert handle.wait() == 1  # the async write is still counted by wait()
        back = torch.empty_like(first)
        handle.pread(back, tmp_path / "a.bin", async_op=True)
        assert handle.wait() == 1
    assert torch.equal(back, first)


def test_intra_op_parallelism_starts_that_many_workers_and_getters(tmp_path: Path) -> None:
    def workers() -> int:
        return sum(t.name.startswith("ds-aio-") for t in threading.enumerate())

    before = workers()
    handle = AioHandle(262144, 16, True, True, 5)
    assert workers() == before + 5
    assert (
        handle.get_block_size(),
        handle.get_queue_depth(),
        handle.get_single_submit(),
        handle.get_overlap_events(),
        handle.get_intra_op_parallelism(),
        handle.get_alignment(),
    ) == (262144, 16, True, True, 5, 4096)
    handle.close()
    assert workers() == before


def test_defaults_match_deepspeed_aio_handle() -> None:
    with AioHandle() as handle:
        assert handle.get_block_size() == 1048576
        assert handle.get_queue_depth() == 128
        assert handle.get_single_submit() is False
        assert handle.get_overlap_events() is False
        assert handle.get_intra_op_parallelism() == 1
