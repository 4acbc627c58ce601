"""The MoE-under-ZeRO-3 benchmark (tools/bench/moe_zero3.py) runs end to end on 2 local ranks.

Tiny sizes keep it fast; the full table is the `bench` nox session's job (and docs/moe.md).
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--vocab", "64", "--seq", "8", "--dim", "32", "--experts", "4", "--batch", "2"]


def _rows(out: str) -> dict[str, list[str]]:
    """The table's rows by mode, cells stripped."""
    rows = {}
    for line in out.splitlines():
        cells = [cell.strip() for cell in line.split("|")]
        if cells[0] in ("ep=1", "ep=2"):
            rows[cells[0]] = cells
    return rows


@pytest.mark.slow  # the bench session runs the bench itself; this smoke run is ~20-35 s
def test_moe_zero3_benchmark_prints_bytes_time_memory_and_loss_per_mode() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools/bench/moe_zero3.py"), *TINY, "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(proc.stdout)
    assert set(rows) == {"ep=1", "ep=2"}, proc.stdout
    # mode | all-gather | (grp) | reduce-scatter | (grp) | all-to-all | all-reduce | total | ...
    base, split = rows["ep=1"], rows["ep=2"]
    assert float(split[1]) < float(base[1])  # the experts are no longer gathered
    assert float(split[3]) < float(base[3])  # nor their gradients reduce-scattered
    assert float(base[5]) == 0.0 < float(split[5])  # tokens travel by all-to-all instead
    assert float(split[-1]) < 1e-4  # the same routing: the losses agree with ep=1
