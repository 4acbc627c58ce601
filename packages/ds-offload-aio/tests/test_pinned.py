"""Page-locked tensors and the staging-buffer pool."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ds_offload_aio import ALIGNMENT, AioHandle, PinnedBufferPool


def _locked_kib(address: int) -> int:
    """VmLck-style check: the locked size of the mapping that holds ``address``."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                inside = start <= address < end
            elif inside and fields[0] == "Locked:":
                return int(fields[1])
    return 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, host memory is pinned by CUDA")
def test_locked_tensor_is_aligned_locked_and_unlocked_by_free() -> None:
    with AioHandle() as handle:
        tensor = handle.new_cpu_locked_tensor(
            3 * 1024 * 1024 + 5, torch.empty(0, dtype=torch.float16)
        )
        assert tensor.dtype == torch.float16 and tensor.numel() == 3 * 1024 * 1024 + 5
        assert tensor.data_ptr() % ALIGNMENT == 0
        assert _locked_kib(tensor.data_ptr()) >= tensor.numel() * 2 // 1024
        assert handle.free_cpu_locked_tensor(tensor) is True
        assert _locked_kib(tensor.data_ptr()) == 0
        assert handle.free_cpu_locked_tensor(tensor) is False  # not twice
        assert handle.free_cpu_locked_tensor(torch.empty(10)) is False


def test_pool_hands_out_aligned_buffers_and_blocks_when_empty() -> None:
    pool = PinnedBufferPool(buffer_bytes=10_000, count=2)
    assert pool.buffer_bytes == 12288 and pool.count == pool.available == 2
    first, second = pool.acquire(), pool.acquire()
    assert {first.data_ptr() % ALIGNMENT, second.data_ptr() % ALIGNMENT} == {0}
    assert first.numel() == second.numel() == 12288 and first.data_ptr() != second.data_ptr()

    got: list[torch.Tensor] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire()))
    waiter.start()
    time.sleep(0.2)
    assert got == []  # blocked: both buffers are out
    pool.release(first)
    waiter.join(timeout=10)
    assert got and got[0].data_ptr() == first.data_ptr()

    with pytest.raises(ValueError, match="release"):
        pool.release(second[:100])
    with pytest.raises(ValueError, match="count = 0"):
        PinnedBufferPool(4096, 0)
    pool.close()
