"""The launcher sees every rank (see [Note: every member is seen]): a node that never starts is
named within ``--node_start_timeout``, and a rank or node that exits 0 while the others run fails
the job after ``--early_exit_grace`` unless ``--allow_early_rank_exit``. Bounds are generous
(a shared machine); the timings themselves are measured by ``tools/bench/launch.py``."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

HOSTS = ("127.0.0.1", "localhost")


def _remote_flags(runner: str, sshd, tmp_path: Path, ssh_options: str):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"{h} slots=1\n" for h in HOSTS))
    flags = [f"--hostfile={hostfile}", f"--launcher={runner}", f"--ssh_port={sshd.port}"]
    if runner == "ssh":
        return [*flags, "--launcher_args", ssh_options], {}
    return flags, {"PDSH_SSH_ARGS_APPEND": ssh_options}


def test_rank_exiting_0_while_others_run_fails_the_job(launcher, out_dir, tmp_path):
    start = time.monotonic()
    result = launcher.run(
        "--num_gpus=2",
        "--early_exit_grace=1",
        "--kill_grace=1",
        *launcher.program("hang", out_dir, "exit0=1"),
        cwd=tmp_path,
        env=launcher.env(CUDA_VISIBLE_DEVICES=""),
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "rank 1 on localhost exited with code 0 while rank 0 on localhost still ran" in (
        result.stderr
    )
    assert "Pass --allow_early_rank_exit" in result.stderr
    assert (out_dir / "signal0").read_text() == "SIGTERM"  # the survivor was stopped
    assert time.monotonic() - start < 60
    launcher.assert_no_leftovers()


def test_allow_early_rank_exit_lets_ranks_finish_apart(launcher, out_dir, tmp_path):
    result = launcher.run(
        "--num_gpus=2",
        "--early_exit_grace=0.5",
        "--allow_early_rank_exit",
        *launcher.program("hang", out_dir, "exit0=1", "finish=2"),
        cwd=tmp_path,
        env=launcher.env(CUDA_VISIBLE_DEVICES=""),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (out_dir / "signal0").exists()


def test_node_exiting_0_while_others_run_fails_a_pdsh_job(launcher, sshd, out_dir, tmp_path):
    # pdsh is one process for every node: the launcher learns that node 1 ended from its agent.
    flags, extra = _remote_flags("pdsh", sshd, tmp_path, sshd.options)
    result = launcher.run(
        *flags,
        "--early_exit_grace=1",
        "--kill_grace=1",
        *launcher.program("hang", out_dir, "exit0=1"),
        cwd=tmp_path,
        env=launcher.env(**extra),
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "node 1 (localhost) exited with code 0 while node 0 (127.0.0.1) still ran" in (
        result.stderr
    )
    assert "#ds-launch-event" not in result.stdout + result.stderr  # taken out of the output
    launcher.assert_no_leftovers()


@pytest.mark.parametrize("runner", [pytest.param("ssh", marks=pytest.mark.slow), "pdsh"])
def test_node_that_never_starts_is_named(launcher, sshd, out_dir, tmp_path, runner):
    # Node 1's connection hangs in a ProxyCommand that never connects: its agent never starts.
    config = tmp_path / "ssh_config"
    config.write_text(f"Host localhost\n  ProxyCommand sh -c 'sleep 300; :' {launcher.token}\n")
    flags, extra = _remote_flags(runner, sshd, tmp_path, f"-F {config} {sshd.options}")
    start = time.monotonic()
    result = launcher.run(
        *flags,
        "--node_start_timeout=5",
        "--kill_grace=1",
        *launcher.program("hang", out_dir),
        cwd=tmp_path,
        env=launcher.env(**extra),
    )
    elapsed = time.monotonic() - start
    assert result.returncode == 1, result.stdout + result.stderr
    assert "node 1 (localhost) did not start within 5 s" in result.stderr, result.stderr
    assert "node 0" not in result.stderr.split("did not start")[0].rsplit("ds-launch:", 1)[-1]
    assert "--node_start_timeout sets the limit" in result.stderr
    assert (out_dir / "ready0").exists()  # node 0 did start, and was stopped
    assert elapsed < 90, elapsed
    launcher.assert_no_leftovers()


@pytest.mark.parametrize("runner", [pytest.param("ssh", marks=pytest.mark.slow), "pdsh"])
def test_ctrl_c_clears_every_node(launcher, sshd, out_dir, tmp_path, runner):
    # Rank 1 ignores SIGINT and SIGTERM (as a rank inside a collective's C code does): only its
    # agent's SIGKILL after --kill_grace stops it, once the connection to its node has dropped.
    # How fast is measured by `tools/bench/launch.py --ctrl-c`; here only that it happens.
    flags, extra = _remote_flags(runner, sshd, tmp_path, sshd.options)
    proc = launcher.start(
        *flags,
        *launcher.program("hang", out_dir, "ignore=1"),
        cwd=tmp_path,
        env=launcher.env(**extra),
    )
    deadline = time.monotonic() + 120
    while len(list(out_dir.glob("ready*"))) < 2:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "ranks never became ready"
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT, stderr
    assert "got SIGINT; passing it on" in stderr
    assert (out_dir / "signal0").read_text() == "SIGTERM"  # from its agent, connection gone
    launcher.assert_no_leftovers(timeout=30)
