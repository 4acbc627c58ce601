"""read_ahead: the page ranges it advises, and that advising a mapped file changes no value."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
import time
from pathlib import Path

import pytest
import torch

from ds_zero import _readahead
from ds_zero._readahead import _MADVISE, _page_ranges, _sampled_pages, read_ahead

sys.path.insert(0, str(Path(__file__).parent))
from _ds_zero_testing import drop_cached_pages


def test_ranges_are_page_aligned_sorted_and_merged() -> None:
    base = torch.zeros(4 * mmap.PAGESIZE // 4)  # four pages of float32
    page_floats = mmap.PAGESIZE // 4
    first = base[10:20]
    overlapping = base[15 : page_floats + 3]
    far = base[3 * page_floats + 1 : 3 * page_floats + 2]
    ranges = _page_ranges([far, overlapping, first])
    start = base.data_ptr() + 40
    assert ranges[0][0] == start - start % mmap.PAGESIZE
    assert ranges[0][1] == overlapping.data_ptr() + overlapping.numel() * 4
    assert len(ranges) == 2
    assert ranges[1][1] == far.data_ptr() + 4
    assert all(a % mmap.PAGESIZE == 0 for a, _ in ranges)


def test_empty_tensors_are_left_out() -> None:
    assert _page_ranges([torch.empty(0)]) == []


def _resident_pages(start: int, stop: int) -> tuple[int, int]:
    """``(resident, total)`` pages of the address range, from ``mincore``."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    pages = (stop - start + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(start, stop - start, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec), pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_advising_a_mapped_file_reads_its_pages_in(tmp_path: Path) -> None:
    """With the file's pages dropped from the page cache, read_ahead brings the advised
    tensor's pages back without anything touching them, and changes no value."""
    assert _MADVISE is not None
    saved = {"a/param": torch.arange(4 << 20, dtype=torch.float32), "a/exp_avg": torch.ones(7)}
    path = tmp_path / "shard.pt"
    torch.save(saved, path)
    drop_cached_pages(path)
    mapped = torch.load(path, mmap=True, weights_only=True)
    ((start, stop),) = _page_ranges([mapped["a/param"]])
    resident, pages = _resident_pages(start, stop)
    assert resident < pages  # cold before the advice (16 MiB: more than the load's read-ahead)
    read_ahead(mapped.values())
    deadline = time.monotonic() + 10
    while _resident_pages(start, stop)[0] < pages and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _resident_pages(start, stop) == (pages, pages)
    assert torch.equal(mapped["a/param"], saved["a/param"])
    assert torch.equal(mapped["a/exp_avg"], saved["a/exp_avg"])


def test_the_sampled_pages_spread_over_every_range() -> None:
    page = mmap.PAGESIZE
    ranges = [(0, 4 * page), (100 * page, 104 * page)]  # 8 pages in two ranges
    assert _sampled_pages(ranges) == [0, page, 2 * page, 3 * page] + [
        (100 + i) * page for i in range(4)
    ]
    many = [(0, 800 * page)]
    assert _sampled_pages(many) == [i * 100 * page for i in range(8)]
    assert _sampled_pages([(page, page + 10)]) == [page]  # fewer bytes than samples: one page
    assert _sampled_pages([]) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_pages_in_memory_are_not_advised_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A warm mapping skips the advice (walking every page of it cost 1.2 ms a 40 MB load); a
    cold one, or one whose residency cannot be told, is advised as before."""
    saved = {"a/param": torch.arange(4 << 20, dtype=torch.float32)}
    path = tmp_path / "shard.pt"
    torch.save(saved, path)
    advised: list[int] = []
    monkeypatch.setattr(
        _readahead, "_MADVISE", lambda start, length, advice: advised.append(length) or 0
    )
    path.read_bytes()  # every page in the page cache
    warm = torch.load(path, mmap=True, weights_only=True)
    read_ahead(warm.values())
    assert advised == []
    monkeypatch.setattr(_readahead, "_MINCORE", None)  # residency unknown: advised
    read_ahead(warm.values())
    assert len(advised) == 1
    monkeypatch.undo()
    drop_cached_pages(path)
    cold = torch.load(path, mmap=True, weights_only=True)
    ((start, stop),) = _page_ranges([cold["a/param"]])
    assert _resident_pages(start, stop)[0] < (stop - start) // mmap.PAGESIZE
    monkeypatch.setattr(
        _readahead, "_MADVISE", lambda start, length, advice: advised.append(length) or 0
    )
    read_ahead(cold.values())
    assert len(advised) == 2
