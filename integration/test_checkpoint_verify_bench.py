"""The checkpoint-verification benchmark (tools/bench/checkpoint_verify.py) runs end to end, the
ways docs/checkpoints.md runs it: one process (warm, cold, phases) and several processes (the
median over them), printing a row per setting with the load time of each arm and the overhead.

Tiny models: this checks the script and its table, not the figures (the `bench` session and
docs/checkpoints.md carry those).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ("--params", "0.2", "--width", "64", "--rounds", "2")
# "| ZeRO-3, weights only (...), 1 MiB | 0.004 | 0.006 | +35.3% | +34.5% [+28.9%, +35.9%] | ..."
ROW = re.compile(
    r"^\| (ZeRO-[23], [^|]+) \| ([0-9.]+) \| ([0-9.]+) \| ([-+][0-9.]+)% "
    r"\| ([-+][0-9.]+)% \[([-+][0-9.]+)%, ([-+][0-9.]+)%\] \|"
)


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools/bench/checkpoint_verify.py"), *TINY, *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _run(*args: str) -> str:
    proc = _bench(*args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _rows(out: str) -> dict[str, tuple[float, ...]]:
    rows = {}
    for line in out.splitlines():
        match = ROW.match(line)
        if match:
            rows[match.group(1).split(",")[1].strip()] = tuple(map(float, match.groups()[1:]))
    return rows


def test_one_process_prints_a_row_per_setting_and_the_phases() -> None:
    out = _run("--stage", "2", "--cold", "--phases")
    rows = _rows(out)
    assert set(rows) == {"full load", "weights only (load_optimizer_states=False)"}, out
    for without, with_, _, paired, low, high in rows.values():
        assert without > 0 and with_ > 0
        assert low <= paired <= high
    assert "cold page cache" in out
    assert "| phase (median ms) |" in out
    whole = next(line for line in out.splitlines() if line.startswith("| whole load |"))
    assert all(float(cell) > 1 for cell in whole.strip("|").split("|")[1:]), whole  # ms, not s
    assert "| PendingVerification.wait |" in out


def test_several_processes_give_the_median_and_each_process() -> None:
    out = _run("--stage", "3", "--no-optimizer-states", "--processes", "2")
    rows = _rows(out)
    assert list(rows) == ["weights only (load_optimizer_states=False)"], out
    *_, paired, low, high = rows["weights only (load_optimizer_states=False)"]
    each = re.search(r"paired overhead of each process: ([-+][0-9.]+)%, ([-+][0-9.]+)%$", out, re.M)
    assert each is not None, out
    assert sorted(map(float, each.groups())) == [low, high]
    assert low <= paired <= high
    assert "2 processes of 2 alternating rounds each" in out


def test_options_that_cannot_apply_are_refused() -> None:
    for args, message in (
        (("--processes", "0"), "--processes 0: give 1 or more"),
        (("--processes", "2", "--phases"), "--phases times the loads of one process"),
    ):
        proc = _bench(*args)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
