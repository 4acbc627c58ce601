"""The checksum threads' core budget: how many threads, and whether one may hash beside a read."""

from __future__ import annotations

import os

import pytest

from ds_zero import _checksums


@pytest.fixture
def four_cores(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    return monkeypatch


def test_a_process_alone_on_four_cores_has_one_to_spare(four_cores: pytest.MonkeyPatch) -> None:
    four_cores.setenv("LOCAL_WORLD_SIZE", "1")
    assert _checksums.spare_core()
    assert _checksums.threads(reserve=1) == 3


def test_two_ranks_on_four_cores_each_have_one_to_spare(four_cores: pytest.MonkeyPatch) -> None:
    four_cores.setenv("LOCAL_WORLD_SIZE", "2")
    assert _checksums.spare_core()
    assert _checksums.threads(reserve=1) == 1


def test_four_ranks_on_four_cores_have_none_to_spare(four_cores: pytest.MonkeyPatch) -> None:
    four_cores.setenv("LOCAL_WORLD_SIZE", "4")
    assert not _checksums.spare_core()
    assert _checksums.threads(reserve=1) == 1  # never fewer than one thread


def test_the_affinity_mask_counts_not_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process pinned to one core (taskset, a container) has none to spare on any machine."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert not _checksums.spare_core()
