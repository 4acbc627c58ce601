"""A ``tools/bench`` script run the way its docstring runs it (one torch thread, from the
workspace root's interpreter), for the integration tests of the benches."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_bench(script: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """``OMP_NUM_THREADS=1 python tools/bench/<script> *args``, its output captured and its exit
    status left to the caller (a test of a refused option expects 2)."""
    return subprocess.run(
        [sys.executable, str(ROOT / "tools/bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
