"""The checkpoint-verification benchmark (tools/bench/checkpoint_verify.py) runs end to end, the
ways docs/checkpoints.md runs it: one process (warm, cold, phases), several processes (the
median over them) and the first loads of fresh processes, printing a row per setting with the load time of each arm and the overhead.

Tiny models: this checks the script and its table, not the figures (the `bench` session and
docs/checkpoints.md carry those).
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys
import types

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from _bench_run import ROOT, run_bench


def _helper(name: str) -> types.ModuleType:
    """``tools/bench/_shared/<name>.py``, loaded from its file (the bench folder is not put on
    ``sys.path``, where its scripts' names, ``zero``, ``comm``..., would shadow other modules)."""
    spec = importlib.util.spec_from_file_location(
        f"_bench_{name}", ROOT / f"tools/bench/_shared/{name}.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


_interval = _helper("median_interval")
median_interval, against_target = _interval.median_interval, _interval.against_target

TINY = ("--params", "0.2", "--width", "64", "--rounds", "2")
# "| ZeRO-3, weights only (...), 1 MiB | 0.004 | 0.006 | +35.3% | +34.5% [+28.9%, +35.9%] | ..."
ROW = re.compile(
    r"^\| (ZeRO-[23], [^|]+) \| ([0-9.]+) \| ([0-9.]+) \| ([-+][0-9.]+)% "
    r"\| ([-+][0-9.]+)% \[([-+][0-9.]+)%, ([-+][0-9.]+)%\] \|"
)


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return run_bench("checkpoint_verify.py", *TINY, *args, timeout=600)


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
    assert "without verify, the model file read into memory" in out
    assert "| phase (median ms) |" in out
    whole = next(line for line in out.splitlines() if line.startswith("| whole load |"))
    assert all(float(cell) > 1 for cell in whole.strip("|").split("|")[1:]), whole  # ms, not s
    for phase in ("wait", "verified_object", "close"):
        assert f"| PendingVerification.{phase} |" in out, out
    module = re.search(r"^\| _load_module \| ([0-9.]+) \| ([0-9.]+) \|$", out, re.M)
    assert module is not None and float(module.group(1)) > 0, out  # both arms set the weights
    assert "| ZeroOptimizer.refresh_fp32_params |" in out, out
    manifest = re.search(r"^\| read_directory_manifest \| ([0-9.]+) \| ([0-9.]+) \|$", out, re.M)
    assert manifest is not None and float(manifest.group(2)) > 0, out  # read only when verified
    faults = re.search(
        r"^\| minor page faults \(median, not ms\) \| ([0-9]+) \| ([0-9]+) \|$", out, re.M
    )
    assert faults is not None, out  # counts, one per arm


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
    assert "the 5% target: not settled: too few values for the interval" in out, out


def test_the_mapped_baseline_maps_the_model_file_in_every_process() -> None:
    """``--mapped-baseline``: the unchecked arm maps the model file and uses it in place, in the
    child processes too (each child reports the baseline it ran, and the parent stops on one
    that differs; the header says which)."""
    out = _run("--stage", "2", "--no-optimizer-states", "--processes", "2", "--mapped-baseline")
    assert "without verify, the model file mapped and used in place" in out, out
    assert list(_rows(out)) == ["weights only (load_optimizer_states=False)"], out
    first = _run("--stage", "2", "--no-optimizer-states", "--first-loads", "1", "--mapped-baseline")
    assert "without verify, the model file mapped and used in place" in first, first


def test_first_loads_time_one_load_of_each_fresh_process() -> None:
    proc = _bench("--stage", "3", "--no-optimizer-states", "--first-loads", "2", "--phases")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    for i in (1, 2):  # each process's load, on stderr
        for arm in ("without verify", "with verify"):
            assert f"ZeRO-3 weights only, process {i} {arm}: " in proc.stderr, proc.stderr
    # --phases: each phase's median over the processes of each arm
    assert "ZeRO-3, weights only (load_optimizer_states=False), first loads" in out, out
    phase = re.search(r"^\| start_verification \| ([0-9.]+) \| ([0-9.]+) \|$", out, re.M)
    assert phase is not None and float(phase.group(2)) > 0, out
    assert "first load of a fresh process, 2 processes per arm" in out, out
    row = re.search(
        r"^\| ZeRO-3, weights only \(load_optimizer_states=False\) \| ([0-9.]+) \| ([0-9.]+) "
        r"\| ([-+][0-9.]+)% \|$",
        out,
        re.M,
    )
    assert row is not None, out
    assert float(row.group(1)) > 0 and float(row.group(2)) > 0
    assert "the 5% target: not settled: too few values for the interval" in out, out


def test_the_median_interval_takes_the_order_statistics_binomial_tails_allow() -> None:
    """At 95%: none below 6 values; the extremes of 6 (coverage 1 - 2/64); the 4th smallest
    and largest of 15 (1 - 2 * 576/32768); the 22nd of 60. The verdict follows the interval."""
    assert median_interval([1.0, 2, 3, 4, 5]) is None
    six = median_interval([6.0, 1, 5, 2, 4, 3])
    assert six is not None and (six.low, six.high, six.rank) == (1, 6, 1)
    assert six.coverage == 1 - 2 / 64
    fifteen = median_interval([float(x) for x in range(15, 0, -1)])
    assert fifteen is not None and (fifteen.low, fifteen.high) == (4, 12)
    assert abs(fifteen.coverage - (1 - 2 * 576 / 32768)) < 1e-12
    sixty = median_interval([float(x) for x in range(60)])
    assert sixty is not None and (sixty.low, sixty.high, sixty.rank) == (21, 38, 22)
    assert 0.95 <= sixty.coverage < 0.98
    assert against_target(sixty, 40).startswith("met")
    assert against_target(sixty, 30).startswith("not settled: the interval straddles")
    assert against_target(sixty, 21).startswith("missed")
    assert against_target(None, 5).startswith("not settled: too few")


def test_options_that_cannot_apply_are_refused() -> None:
    for args, message in (
        (("--processes", "0"), "--processes 0: give 1 or more"),
        (("--processes", "2", "--phases"), "--phases times the loads of one process"),
        (("--first-loads", "2", "--processes", "2"), "--first-loads times one warm load"),
        (("--first-loads", "2", "--cold"), "--first-loads times one warm load a process"),
    ):
        proc = _bench(*args)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
