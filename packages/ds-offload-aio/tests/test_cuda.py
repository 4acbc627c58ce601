"""CUDA tensors through pinned bounce buffers (and GDS where kvikio is installed)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ds_offload_aio import AioHandle, AsyncTensorSwapper, GdsHandle, PinnedBufferPool, tune

Bytes = Callable[..., torch.Tensor]
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("nbytes", [1, 4097, (3 << 20) + 5, 40 << 20])
@pytest.mark.parametrize("offset", [0, 12345])
def test_cuda_round_trip(tmp_path: Path, random_bytes: Bytes, nbytes: int, offset: int) -> None:
    data = random_bytes(nbytes, nbytes).cuda()
    with AioHandle(intra_op_parallelism=3) as handle:
        handle.sync_pwrite(data, tmp_path / "g.bin", offset=offset)
        back = torch.zeros_like(data)
        handle.async_pread(back, tmp_path / "g.bin", offset=offset)
        assert handle.wait() == 1
    assert torch.equal(back, data)


def test_cuda_tensors_swap_through_the_pool(tmp_path: Path) -> None:
    tensors = [torch.randn(1 << 20, device="cuda"), torch.randn(7, device="cuda").half()]
    paths = [tmp_path / "a.swp", tmp_path / "b.swp"]
    with AioHandle() as handle:
        swapper = AsyncTensorSwapper(handle, PinnedBufferPool(buffer_bytes=1 << 20, count=2))
        swapper.swap_out(tensors, paths)
        back = [torch.empty_like(t) for t in tensors]
        swapper.swap_in(back, paths, async_op=True)
        swapper.wait()
    for expected, got in zip(tensors, back):
        assert torch.equal(got, expected)


def test_tune_on_a_cuda_buffer(tmp_path: Path) -> None:
    results = tune(tmp_path, 8 << 20, {"block_size": ["1M"], "queue_depth": [8],
                   "intra_op_parallelism": [1, 2], "single_submit": [False],
                   "overlap_events": [True]}, device="cuda", progress=False)  # fmt: skip
    assert len(results) == 2 and all(r.read_gbps and r.write_gbps for r in results)


@pytest.mark.skipif(importlib.util.find_spec("kvikio") is None, reason="needs kvikio (GDS)")
def test_gds_round_trip(tmp_path: Path, random_bytes: Bytes) -> None:
    data = random_bytes((1 << 20) + 3, 0).cuda()
    handle = GdsHandle()
    handle.sync_pwrite(data, tmp_path / "gds.bin")
    back = torch.zeros_like(data)
    handle.sync_pread(back, tmp_path / "gds.bin")
    assert torch.equal(back, data)
