"""The AutoTP and Ulysses benchmarks (tools/bench/autotp.py, ulysses.py) run end to end on 2 local
ranks and print the communication bytes the comms logger counted, next to their hand count.

Both are in the slow tier (the `bench` nox session runs the benches themselves); the full tables
are the `bench` session's job (and docs/tensor_parallel.md, docs/sequence_parallel.md).
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# "... = 0.4375 MiB/step (measured all-reduce: 0.4375 MiB)": the footer's hand count and measure.
HAND_COUNT = re.compile(r"= ([0-9.]+) MiB/step \(measured [a-z-]+: ([0-9.]+) MiB\)")


def _run(script: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools/bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _rows(out: str, modes: tuple[str, ...]) -> dict[str, list[str]]:
    """The table's rows by their first cell (the mode)."""
    rows = {}
    for line in out.splitlines():
        cells = line.split()
        if cells and cells[0] in modes:
            rows[cells[0]] = cells
    return rows


def _assert_hand_count_matches(out: str) -> None:
    """The bytes the comms logger measured are the footer's hand count, within 1%."""
    match = HAND_COUNT.search(out)
    assert match is not None, out
    expected, measured = map(float, match.groups())
    assert expected > 0.0 and abs(measured - expected) <= 0.01 * expected + 1e-4, out


@pytest.mark.slow  # 4 rank processes (tp1 x dp2, tp2 x dp1): ~40 s of CPU
def test_autotp_benchmark_counts_the_tensor_parallel_all_reduces() -> None:
    tiny = ["--dim", "32", "--heads", "4", "--layers", "1", "--vocab", "64", "--seq", "8"]
    out = _run("autotp.py", *tiny, "--steps", "2", "--warmup", "1")
    rows = _rows(out, ("tp1", "tp2"))
    assert set(rows) == {"tp1", "tp2"}, out
    # mode x dpN | all-reduce | all-gather | reduce-scatter | ms | ... | last loss
    base, split = rows["tp1"], rows["tp2"]
    assert "all-reduce MiB" in out and "red.-scat. MiB" in out
    assert float(base[5]) > 0.0  # dp2: ZeRO-1 reduce-scatters the gradients...
    assert float(split[5]) == 0.0  # ...and dp1 has nothing to reduce
    assert float(split[3]) > 0.0  # the row-parallel outputs and column-parallel input grads
    _assert_hand_count_matches(out)
    assert abs(float(base[-1]) - float(split[-1])) < 1e-4  # the same batch: the same loss


@pytest.mark.slow  # the bench session runs the bench itself; this smoke run is ~20-35 s
def test_ulysses_benchmark_counts_the_distributed_attention_all_to_alls() -> None:
    tiny = ["--seq", "64", "--dim", "32", "--heads", "4", "--layers", "1", "--vocab", "64"]
    out = _run("ulysses.py", *tiny, "--steps", "2", "--warmup", "1")
    rows = _rows(out, ("sp1", "sp2"))
    assert set(rows) == {"sp1", "sp2"}, out
    # mode | tokens/rank | all-to-all | all-reduce | all-gather | reduce-scatter | ...
    base, split = rows["sp1"], rows["sp2"]
    assert "all-to-all MiB" in out
    assert float(base[2]) == 0.0 < float(split[2])  # one rank: no collective at all
    _assert_hand_count_matches(out)
    assert abs(float(base[-1]) - float(split[-1])) < 1e-4  # SP=2 matches SP=1
