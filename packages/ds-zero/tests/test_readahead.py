"""read_ahead: the page ranges it advises, and that advising a mapped file changes no value."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import pytest
import torch

from ds_zero._readahead import _MADVISE, _page_ranges, read_ahead


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_advising_a_mapped_file_keeps_its_values(tmp_path: Path) -> None:
    assert _MADVISE is not None
    saved = {"a/param": torch.arange(300_000, dtype=torch.float32), "a/exp_avg": torch.ones(7)}
    torch.save(saved, tmp_path / "shard.pt")
    mapped = torch.load(tmp_path / "shard.pt", mmap=True, weights_only=True)
    read_ahead(mapped.values())
    assert torch.equal(mapped["a/param"], saved["a/param"])
    assert torch.equal(mapped["a/exp_avg"], saved["a/exp_avg"])
