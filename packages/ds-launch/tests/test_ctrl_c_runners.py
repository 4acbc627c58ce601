"""Ctrl-C under the runners this machine has no real tool for (openmpi, impi, mvapich: their
``mpirun``; slurm: ``srun``): a stand-in tool on PATH records the signal it gets and starts a
"rank" of its own. The launcher must pass the SIGINT on to the tool (which passes it to its
ranks, as the real ones do) and be gone, with every process of the job, within 5 s (see
[Note: Ctrl-C within 5 s]): also when the tool and its rank ignore the signal, which leaves
only the launcher's SIGKILL after ``--kill_grace`` (3 s by default). mpich runs for real in
``test_mpi_runner.py``; ssh and pdsh in ``test_liveness.py``. The stubborn case (the slowest)
is the default tier; the cooperative one is slow-tier.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

TOOLS = {"openmpi": "mpirun", "impi": "mpirun", "mvapich": "mpirun", "slurm": "srun"}

# The stand-in tool: argv[1:] is what ds-launch passes (its flags, then the rank program with
# the test's token, so every process here is found by it). It starts one rank, writes "ready",
# and on SIGINT records it and (cooperative) passes it on and exits as a real tool does, or
# (stubborn) ignores it, as does its rank.
_TOOL = """#!{python}
import os, signal, subprocess, sys, time
from pathlib import Path

out, mode, token = Path(os.environ["DSTEST_TOOL_OUT"]), os.environ["DSTEST_TOOL_MODE"], sys.argv[-1]
(out / "argv").write_text("\\n".join(sys.argv[1:]))
ignore = "signal.signal(signal.SIGINT, signal.SIG_IGN); signal.signal(signal.SIGTERM, signal.SIG_IGN); "
code = "import signal, time; " + (ignore if mode == "stubborn" else "") + "time.sleep(300)"
rank = subprocess.Popen([sys.executable, "-c", code, token])


def on_signal(signum, frame):
    (out / "signal").write_text(signal.Signals(signum).name)
    if mode == "cooperative":
        rank.send_signal(signum)
        rank.wait()
        sys.exit(128 + signum)


signal.signal(signal.SIGINT, on_signal)
signal.signal(signal.SIGTERM, on_signal)
time.sleep(0.5)  # the rank is up
(out / "ready").write_text(str(rank.pid))
while True:
    time.sleep(1)
"""


@pytest.mark.parametrize("mode", [pytest.param("cooperative", marks=pytest.mark.slow), "stubborn"])
@pytest.mark.parametrize("runner", sorted(TOOLS))
def test_ctrl_c_reaches_the_runner_and_clears_the_job_within_5_s(
    launcher, out_dir, tmp_path, runner, mode
):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / TOOLS[runner]
    tool.write_text(_TOOL.format(python=sys.executable))
    tool.chmod(0o755)
    env = launcher.env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        DSTEST_TOOL_OUT=str(out_dir),
        DSTEST_TOOL_MODE=mode,
        CUDA_VISIBLE_DEVICES="",
    )
    proc = launcher.start(
        f"--launcher={runner}",
        "--force_multi",
        "--num_gpus=2",
        f"--master_port={launcher.free_port()}",
        *launcher.program("hang", out_dir),
        cwd=tmp_path,
        env=env,
    )
    deadline = time.monotonic() + 120
    while not (out_dir / "ready").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the stand-in tool never started"
        time.sleep(0.05)
    assert (out_dir / "argv").read_text().split("\n")[-1] == launcher.token
    start = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    _, stderr = proc.communicate(timeout=60)
    launcher.assert_no_leftovers(timeout=5.0 - (time.monotonic() - start))
    elapsed = time.monotonic() - start
    assert proc.returncode == 128 + signal.SIGINT, stderr
    assert "got SIGINT; passing it on" in stderr
    assert (out_dir / "signal").read_text() == "SIGINT"  # passed on as SIGINT, not replaced
    print(f"{runner} ({mode}): {elapsed:.2f} s from Ctrl-C to no process left")
    assert elapsed < 5.0, f"{runner} ({mode}): {elapsed:.2f} s from Ctrl-C to no process left"
