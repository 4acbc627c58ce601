"""The ssh and pdsh runners launching a real 2-"node" job on this machine, through an sshd the
fixture starts on a loopback port with a throwaway key. The two nodes are two names of this
machine (``127.0.0.1`` and ``localhost``); sshd gives each a fresh environment, so what the
ranks see came through the runner's exports."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

HOSTS = ("127.0.0.1", "localhost")


def _runner_flags(launcher_name: str, sshd, hostfile: Path) -> tuple[list[str], dict[str, str]]:
    """ds-launch flags and environment that point the runner at the test's sshd."""
    flags = [f"--hostfile={hostfile}", f"--launcher={launcher_name}", f"--ssh_port={sshd.port}"]
    if launcher_name == "ssh":
        return [*flags, "--launcher_args", sshd.options], {}
    return flags, {"PDSH_SSH_ARGS_APPEND": sshd.options}


@pytest.fixture
def hostfile(tmp_path: Path) -> Path:
    path = tmp_path / "hostfile"
    path.write_text("# two names of this machine\n" + "".join(f"{h} slots=1\n" for h in HOSTS))
    return path


@pytest.mark.parametrize("launcher_name", ["ssh", "pdsh"])
def test_two_node_job_all_reduces_with_exported_environment(
    launcher, sshd, hostfile, out_dir, tmp_path, launcher_name
):
    flags, extra_env = _runner_flags(launcher_name, sshd, hostfile)
    (tmp_path / ".deepspeed_env").write_text("# for every rank\nDSTEST_FROM_FILE = yes\n")
    (tmp_path / "activate").write_text("export DSTEST_VENV=sourced\n")  # --venv_script
    env = launcher.env(
        **extra_env,
        NCCL_DSTEST="nccl",
        FI_DSTEST="fi",
        UCX_DSTEST="ucx",
        PYTHON_DSTEST="py",
        DSTEST_NOT_EXPORTED="1",
        HOME=str(tmp_path / "home"),
    )
    port = launcher.free_port()
    result = launcher.run(
        *flags,
        f"--master_port={port}",
        "--venv_script=activate",
        *launcher.program("allreduce", out_dir),
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(2):
        res = json.loads((out_dir / f"rank{rank}.json").read_text())
        assert res["sum"] == 1.0
        assert res["launch"] == [rank, 2, 0, "torchrun"]
        assert res["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": HOSTS[0],
            "MASTER_PORT": str(port),
            "CROSS_RANK": str(rank),
            "CROSS_SIZE": "2",
            "CUDA_VISIBLE_DEVICES": "0",  # hostfile slots are GPU ids
        }
        assert res["dstest"] == {
            "NCCL_DSTEST": "nccl",
            "FI_DSTEST": "fi",
            "UCX_DSTEST": "ucx",
            "PYTHON_DSTEST": "py",
            "DSTEST_FROM_FILE": "yes",
            "DSTEST_VENV": "sourced",
        }
        assert res["cwd"] == str(tmp_path)
        assert res["local_rank_args"] == ["--local_rank=0"]
        assert f"[rank{rank}] rank {rank} done" in result.stdout


@pytest.mark.parametrize("launcher_name", ["ssh", "pdsh"])
def test_failure_on_one_node_stops_the_other(
    launcher, sshd, hostfile, out_dir, tmp_path, launcher_name
):
    # Node 1's rank exits 5 once both are ready; node 0's rank ignores SIGTERM and must be
    # killed by its own agent after the grace period, once its ssh connection is gone.
    flags, extra_env = _runner_flags(launcher_name, sshd, hostfile)
    start = time.monotonic()
    result = launcher.run(
        *flags,
        "--kill_grace=1",
        *launcher.program("hang", out_dir, "crash=1:5", "ignore=0"),
        cwd=tmp_path,
        env=launcher.env(**extra_env),
    )
    assert result.returncode == 5, result.stdout + result.stderr
    assert "rank 1 on localhost (pid" in result.stderr
    assert "exited with code 5" in result.stderr
    assert time.monotonic() - start < 90
    launcher.assert_no_leftovers()
