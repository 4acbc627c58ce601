"""The tensor swapper: round trips through a small pool, errors, and ranks sharing one disk."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ds_offload_aio import AioError, AioHandle, AsyncTensorSwapper, PinnedBufferPool
from ds_testing import run_on_ranks

Bytes = Callable[..., torch.Tensor]


def _tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(1000, 37, generator=generator),  # 148000 B: several pool buffers
        torch.randn(5, generator=generator).to(torch.bfloat16),
        torch.randint(-100, 100, (4096,), generator=generator, dtype=torch.int64),
        torch.empty(0),
        torch.randn(3, 3, generator=generator)[:, 1],  # non-contiguous
    ]


@pytest.mark.parametrize("async_op", [False, True])
def test_round_trip_through_a_pool_smaller_than_the_tensors(
    tmp_path: Path, backend: str, async_op: bool
) -> None:
    tensors = _tensors(seed=0)
    paths = [tmp_path / f"t{i}.swp" for i in range(len(tensors))]
    with AioHandle(intra_op_parallelism=2, backend=backend) as handle:  # type: ignore[arg-type]
        swapper = AsyncTensorSwapper(handle, PinnedBufferPool(buffer_bytes=16384, count=2))
        swapper.swap_out(tensors, paths, async_op=async_op)
        if async_op:
            assert swapper.wait() <= 2  # at most one write per buffer still in flight
        assert [os.path.getsize(p) for p in paths] == [
            t.numel() * t.element_size() for t in tensors
        ]

        back = [torch.full(t.shape, 7, dtype=t.dtype) for t in tensors]
        swapper.swap_in(back, paths, async_op=async_op)
        if async_op:
            assert swapper.wait() == 2  # the last pieces were still loading
    for expected, got in zip(tensors, back):
        assert torch.equal(got, expected)


def test_swap_out_copies_so_the_caller_may_reuse_the_tensors(tmp_path: Path) -> None:
    tensor = torch.arange(100_000, dtype=torch.float32)
    with AioHandle() as handle:
        swapper = AsyncTensorSwapper(handle, PinnedBufferPool(buffer_bytes=1 << 16, count=3))
        swapper.swap_out([tensor], [tmp_path / "a.swp"], async_op=True)
        tensor.zero_()  # allowed as soon as swap_out returns
        swapper.wait()
        swapper.swap_in([tensor], [tmp_path / "a.swp"])
    assert torch.equal(tensor, torch.arange(100_000, dtype=torch.float32))


def test_errors_surface_and_buffers_come_back(tmp_path: Path) -> None:
    pool = PinnedBufferPool(buffer_bytes=4096, count=2)
    with AioHandle() as handle:
        swapper = AsyncTensorSwapper(handle, pool)
        swapper.swap_out([torch.ones(1000)], [tmp_path / "ok.swp"])
        targets = [torch.empty(1000), torch.empty(10)]
        with pytest.raises(AioError) as info:
            swapper.swap_in(targets, [tmp_path / "ok.swp", tmp_path / "missing.swp"])
        assert info.value.filename == str(tmp_path / "missing.swp")
        assert torch.equal(targets[0], torch.ones(1000))
        assert swapper.wait() == 0
        with pytest.raises(ValueError, match="2 tensors but 1 paths"):
            swapper.swap_out(targets, [tmp_path / "x"])
    assert pool.available == pool.count  # every buffer came back


def _swap_through_shared_disk(rank: int, world_size: int, *, directory: str) -> float:
    """Each rank swaps its shard to the shared directory, then reads its neighbour's back."""
    import torch.distributed as dist

    def shard(r: int) -> torch.Tensor:
        return torch.randn(30_011, generator=torch.Generator().manual_seed(100 + r))

    with AioHandle(intra_op_parallelism=2) as handle:
        swapper = AsyncTensorSwapper(handle, PinnedBufferPool(buffer_bytes=1 << 15, count=2))
        swapper.swap_out([shard(rank)], [os.path.join(directory, f"rank{rank}.swp")])
        dist.barrier()
        neighbour = (rank + 1) % world_size
        back = torch.empty(30_011)
        swapper.swap_in([back], [os.path.join(directory, f"rank{neighbour}.swp")])
        dist.barrier()  # nobody leaves while a neighbour may still read its file
    assert torch.equal(back, shard(neighbour))  # reference computed in the rank
    return float(back[0])


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_ranks_swap_through_one_directory(tmp_path: Path, world_size: int) -> None:
    firsts = run_on_ranks(
        _swap_through_shared_disk, world_size, directory=str(tmp_path), timeout=300
    )
    expected = [
        float(
            torch.randn(
                30_011, generator=torch.Generator().manual_seed(100 + (r + 1) % world_size)
            )[0]
        )
        for r in range(world_size)
    ]
    assert firsts == expected
