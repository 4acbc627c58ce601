"""Page-locked tensors and the staging-buffer pool."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ds_offload_aio import ALIGNMENT, AioHandle, PinnedBufferPool


def _mapping(address: int) -> dict[str, list[str]]:
    """The /proc/self/smaps entry of the mapping holding ``address``: field -> values.

    The header line's fields are under ``"header"`` (range, permissions such as ``rw-p``, ...).
    """
    entry: dict[str, list[str]] = {}
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                if inside:
                    break
                start, end = (int(x, 16) for x in fields[0].split("-"))
                inside = start <= address < end
                entry = {"header": fields}
            elif inside:
                entry[fields[0].rstrip(":")] = fields[1:]
    return entry if inside else {}


def _locked_kib(address: int) -> int:
    """VmLck-style check: the locked size of the mapping that holds ``address``."""
    return int(_mapping(address).get("Locked", ["0"])[0])


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, host memory is pinned by CUDA")
def test_large_locked_tensor_asks_for_huge_pages() -> None:
    # [Note: huge pages for locked buffers]: private, 2 MiB aligned, advised MADV_HUGEPAGE.
    # Whether the kernel grants huge pages depends on the machine, so that is not asserted.
    with AioHandle() as handle:
        tensor = handle.new_cpu_locked_tensor(5 << 19, torch.empty(0, dtype=torch.float32))
        assert tensor.data_ptr() % (2 << 20) == 0
        mapping = _mapping(tensor.data_ptr())
        assert mapping["header"][1].endswith("p")  # private: shmem ignores MADV_HUGEPAGE
        assert "hg" in mapping["VmFlags"] and "lo" in mapping["VmFlags"]
        assert tensor.numel() == 5 << 19 and tensor.dtype == torch.float32
        tensor.fill_(7)
        assert torch.equal(tensor, torch.full_like(tensor, 7))
        assert handle.free_cpu_locked_tensor(tensor) is True
        assert "lo" not in _mapping(tensor.data_ptr())["VmFlags"]
        small = handle.new_cpu_locked_tensor(100, torch.empty(0, dtype=torch.uint8))
        assert "hg" not in _mapping(small.data_ptr())["VmFlags"]  # under 2 MiB: no slack


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
