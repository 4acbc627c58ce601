"""Page-aligned, page-locked host memory: single tensors and a pool of staging buffers.

[Note: huge pages for locked buffers]
Without CUDA, locked buffers of 2 MiB or more are a private anonymous mapping advised
``MADV_HUGEPAGE`` and started on a 2 MiB boundary, so the kernel backs them with transparent
huge pages when it has them (``/sys/kernel/mm/transparent_hugepage/enabled`` set to ``madvise``
or ``always``). An O_DIRECT request then pins one compound page instead of 256 small ones, and
its memory is physically contiguous: a 1 MiB request is one DMA segment rather than up to 256,
so the block layer does not split it (virtio-blk, for one, takes at most 254 segments a request)
and the device, or the hypervisor behind a virtual disk, gathers one range instead of hundreds.
On the development VM this alone took a 512 MiB O_DIRECT write from 2.5 to 3.4 GB/s and a read
from 2.5 to 3.9 GB/s (docs/aio.md, "Benchmark"). A shared mapping (Python's ``mmap`` default)
is shmem, which has its own THP switch, off by default; hence ``MAP_PRIVATE``. Where the kernel
has no huge page to give (THP off, memory fragmented) the mapping keeps 4 KiB pages: same
behaviour, no error. DeepSpeed pins with ``torch.empty(..., pin_memory=True)``, which needs
CUDA; with CUDA this package does the same (``cudaHostAlloc`` decides the page size).
ds-zero maps its verified checkpoint copies the same way, unlocked (ds-zero's [Note: copying
while verifying]); a change to one mapping should be made to both.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading

import torch

from ds_offload_aio import _ext
from ds_offload_aio.api import ALIGNMENT

_LIBC = ctypes.CDLL(None, use_errno=True)
HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages) PMD size


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _lock(address: int, nbytes: int) -> str | None:
    """mlock; returns why it failed (None on success)."""
    if _LIBC.mlock(ctypes.c_void_p(address), ctypes.c_size_t(nbytes)) == 0:
        return None
    return f"mlock: {os.strerror(ctypes.get_errno())}; raise `ulimit -l`"


def allocate_locked(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-aligned host memory that O_DIRECT can use in place, as uint8.

    With CUDA this is pinned memory (``cudaHostAlloc``: fast host<->device copies). Without it,
    a private anonymous mapping in transparent huge pages where the kernel grants them (see
    [Note: huge pages for locked buffers]) and locked with ``mlock`` (when that fails, e.g. past
    ``ulimit -l``, the memory stays pageable and a warning says so once); unmapped when the last
    tensor using it is freed.
    """
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if torch.cuda.is_available():
        raw = torch.empty(nbytes + ALIGNMENT, dtype=torch.uint8, pin_memory=True)
        shift = -raw.data_ptr() % ALIGNMENT
        return raw[shift : shift + nbytes]
    huge = nbytes >= HUGE_PAGE
    # The slack lets the tensor start on a huge-page boundary; never touched, so never resident.
    region = mmap.mmap(
        -1,
        round_up(nbytes, mmap.PAGESIZE) + (HUGE_PAGE if huge else 0),
        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
    )
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel without THP: 4 KiB pages, still correct
            region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    shift = -raw.data_ptr() % HUGE_PAGE if huge else 0
    tensor = raw[shift : shift + nbytes]
    reason = _lock(tensor.data_ptr(), nbytes)
    if reason is not None:
        _ext.warn_once(f"ds_offload_aio: host buffers are not page-locked ({reason})")
    return tensor


def release_locked(tensor: torch.Tensor) -> None:
    """Unlocks memory from ``allocate_locked`` early; it is unmapped when unreferenced."""
    if tensor.device.type == "cpu" and not torch.cuda.is_available() and tensor.numel():
        storage = tensor.untyped_storage()  # the whole mapping, slack included
        _LIBC.munlock(ctypes.c_void_p(storage.data_ptr()), ctypes.c_size_t(storage.nbytes()))


class PinnedBufferPool:
    """A fixed set of equal, page-aligned, page-locked staging buffers, one allocation in all.

    ``acquire`` blocks until a buffer is free. The tensor swapper stages tensors through one;
    each ``AioHandle`` keeps one for the bounce buffers of memory O_DIRECT cannot use.

    Example:
        >>> pool = PinnedBufferPool(buffer_bytes=64 << 20, count=4)
        >>> buf = pool.acquire()          # uint8 tensor of 64 MiB
        >>> pool.release(buf)
    """

    def __init__(self, buffer_bytes: int, count: int) -> None:
        if isinstance(buffer_bytes, bool) or not isinstance(buffer_bytes, int) or buffer_bytes <= 0:
            raise ValueError(f"buffer_bytes = {buffer_bytes!r}: expected a positive integer")
        if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
            raise ValueError(f"count = {count!r}: expected a positive integer")
        self._buffer_bytes = round_up(buffer_bytes, ALIGNMENT)
        self._memory = allocate_locked(self._buffer_bytes * count)
        self._buffers = list(self._memory.split(self._buffer_bytes))
        self._starts = {b.data_ptr() for b in self._buffers}
        self._free = list(reversed(self._buffers))
        self._cond = threading.Condition()

    @property
    def buffer_bytes(self) -> int:
        """Size of each buffer: the requested size rounded up to the 4 KiB alignment."""
        return self._buffer_bytes

    @property
    def count(self) -> int:
        return len(self._buffers)

    @property
    def available(self) -> int:
        """How many buffers are free right now."""
        with self._cond:
            return len(self._free)

    def acquire(self) -> torch.Tensor:
        """A free buffer (uint8, ``buffer_bytes`` long); blocks until one is released."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._free))
            return self._free.pop()

    def release(self, buffer: torch.Tensor) -> None:
        """Returns a buffer from ``acquire`` (the whole tensor ``acquire`` gave, not a slice)."""
        if buffer.data_ptr() not in self._starts or buffer.numel() != self._buffer_bytes:
            raise ValueError("release() takes a buffer this pool's acquire() returned")
        with self._cond:
            self._free.append(buffer)
            self._cond.notify()

    def close(self) -> None:
        """Unlocks the memory now (it is freed once no buffer is referenced)."""
        release_locked(self._memory)
