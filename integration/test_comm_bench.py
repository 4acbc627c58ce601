"""The ds-comm bandwidth benchmark (tools/bench/comm.py) runs end to end on 2 local ranks.

A small size range keeps it fast; the full table is the `bench` nox session's job.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow  # the bench session runs the bench itself; this smoke run is ~20-35 s
def test_comm_benchmark_prints_a_table_per_op_on_two_ranks() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools/bench/comm.py"),
            "--world-size",
            "2",
            "--min-bytes",
            "1K",
            "--max-bytes",
            "64K",
            "--warmup",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for op in (
        "all_reduce",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_to_all_single",
    ):
        assert op in out, f"no table for {op}:\n{out}"
    assert "busbw" in out.lower()
