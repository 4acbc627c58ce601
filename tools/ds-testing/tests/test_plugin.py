"""The pytest plugin, exercised through a real ``pytest`` subprocess on a generated test file."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from ds_testing import gpu_count

_TEST_FILE = """
import time

import pytest

from ds_testing import gpu_count, run_on_ranks


def _hang(rank, world_size):
    time.sleep(3600)


def test_default_timeout_comes_from_the_option():
    run_on_ranks(_hang, 1)


@pytest.mark.gpu({too_many})
def test_needs_more_gpus_than_present():
    raise AssertionError("should have been skipped")


@pytest.mark.slow
def test_slow_marker_is_registered():
    pass
"""


def test_gpu_marker_skips_and_ds_timeout_sets_default(tmp_path: Path) -> None:
    too_many = gpu_count() + 1
    (tmp_path / "test_generated.py").write_text(
        textwrap.dedent(_TEST_FILE).format(too_many=too_many)
    )
    args = ["-rs", "--strict-markers", "-p", "no:cacheprovider", "--ds-timeout", "2", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--import-mode=importlib", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert "1 failed, 1 passed, 1 skipped" in out, out
    assert "ranks [0] did not finish within 2.0 s" in out
    assert f"needs {too_many} CUDA GPU(s), {too_many - 1} present" in out
