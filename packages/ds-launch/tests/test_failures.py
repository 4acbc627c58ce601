"""Failure propagation of a local launch: a crashing rank, a rank that ignores SIGTERM, signals to
the launcher, and a SIGKILLed launcher. Exit codes are checked, and the process table must hold
nothing of the job afterwards (ranks, their grandchildren, the launcher's watchdog)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

GRACE_S = 1.0


def _wait_ready(out_dir: Path, count: int, proc) -> None:
    deadline = time.monotonic() + 120
    while len(list(out_dir.glob("ready*"))) < count:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "ranks never became ready"
        time.sleep(0.05)


def test_crash_stops_the_other_ranks_and_returns_its_code(launcher, out_dir, tmp_path):
    # Rank 0 ignores SIGTERM: only the SIGKILL after the grace period stops it.
    start = time.monotonic()
    result = launcher.run(
        "--num_gpus=3",
        f"--kill_grace={GRACE_S}",
        *launcher.program("hang", out_dir, "crash=1:7", "ignore=0"),
        cwd=tmp_path,
        env=launcher.env(CUDA_VISIBLE_DEVICES=""),
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 7, result.stderr
    stderr = result.stderr.splitlines()
    assert any(
        line.startswith("ds-launch: rank 1 on localhost (pid ") and "exited with code 7" in line
        for line in stderr
    ), result.stderr
    # The report ends the output: which rank, then its last lines with their prefix.
    assert stderr[-3:] == [
        stderr[-3],
        "    [rank1] rank 1 ready",
        "    [rank1] rank 1 failing now",
    ]
    assert "its last 2 line(s):" in stderr[-3]
    assert (out_dir / "signal2").read_text() == "SIGTERM"  # rank 2 was asked to stop
    assert not (out_dir / "signal0").exists()  # rank 0 ignored it and was killed
    assert elapsed < 60, elapsed
    launcher.assert_no_leftovers()


def test_rank_killed_by_a_signal_is_reported_as_such(launcher, out_dir, tmp_path):
    result = launcher.run(
        "--num_gpus=2",
        f"--kill_grace={GRACE_S}",
        *launcher.program("hang", out_dir, "kill=0"),
        cwd=tmp_path,
        env=launcher.env(CUDA_VISIBLE_DEVICES=""),
    )
    assert result.returncode == 128 + signal.SIGKILL, result.stderr
    assert "rank 0 on localhost" in result.stderr
    assert "was killed by SIGKILL" in result.stderr
    launcher.assert_no_leftovers()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_to_the_launcher_reaches_every_rank(launcher, out_dir, tmp_path, sig):
    # Rank 1 ignores the signal, so the launcher must escalate to SIGKILL after the grace.
    proc = launcher.start(
        "--num_gpus=3",
        f"--kill_grace={GRACE_S}",
        *launcher.program("hang", out_dir, "ignore=1"),
        cwd=tmp_path,
        env=launcher.env(CUDA_VISIBLE_DEVICES=""),
    )
    _wait_ready(out_dir, 3, proc)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, stderr
    assert f"got {signal.Signals(sig).name}; passing it on to 3 rank(s)" in stderr
    for rank in (0, 2):
        assert (out_dir / f"signal{rank}").read_text() == signal.Signals(sig).name
    assert not (out_dir / "signal1").exists()
    launcher.assert_no_leftovers()


def test_sigkilled_launcher_leaves_no_process_behind(launcher, out_dir, tmp_path):
    proc = launcher.start(
        "--num_gpus=2",
        *launcher.program("hang", out_dir, "ignore=0"),
        cwd=tmp_path,
        env=launcher.env(CUDA_VISIBLE_DEVICES=""),
    )
    _wait_ready(out_dir, 2, proc)
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    # Ranks die through PR_SET_PDEATHSIG, their grandchildren through the watchdog.
    launcher.assert_no_leftovers()
