"""Start the disk reads of a mapped checkpoint's wanted bytes before anything touches them.

[Note: read-ahead of mapped shards]
A load maps its shard files (``torch.load(mmap=True)``) and reads only some of their tensors
(the fp32 masters, for a weights-only load). From a cold page cache, each first touch of a
mapped page is a synchronous fault that reads a small window around it, and the checksum
threads and the loader touch the mapping in different places, so the disk sees short, scattered
reads and every thread waits on them in turn. ``madvise(MADV_WILLNEED)`` over the wanted
tensors' byte ranges, issued once when the files are mapped, queues their reads at once in
file order; the threads then find the pages in the page cache, or wait on reads already in
flight. It is advice: where the call is missing (not Linux) or refused, nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
from collections.abc import Callable, Iterable

import torch

__all__ = ["read_ahead"]

_MADV_WILLNEED = 3  # Linux's value (asm-generic/mman-common.h)


def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    call = libc.madvise
    call.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    call.restype = ctypes.c_int
    return call


_MADVISE = _madvise()


def _page_ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """The page-aligned ``(start, stop)`` address ranges of ``tensors``' bytes, merged."""
    page = mmap.PAGESIZE
    spans = []
    for t in tensors:
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        start = t.data_ptr()
        stop = start + t.numel() * t.element_size()
        spans.append((start - start % page, stop))
    merged: list[tuple[int, int]] = []
    for start, stop in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def read_ahead(tensors: Iterable[torch.Tensor]) -> None:
    """Ask the kernel to read the pages under ``tensors`` (mapped from files) in the
    background (see [Note: read-ahead of mapped shards]); returns at once."""
    if _MADVISE is None:
        return
    for start, stop in _page_ranges(tensors):
        _MADVISE(start, stop - start, _MADV_WILLNEED)  # advice: a refusal changes nothing
