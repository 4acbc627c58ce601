"""Local launches through the real ``ds-launch`` script: ranks find each other (a ds-comm
all_reduce), see the documented environment, and their output reaches the console prefixed."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest


def _results(out_dir: Path, world_size: int) -> list[dict]:
    files = sorted(out_dir.glob("rank*.json"))
    assert len(files) == world_size, [f.name for f in files]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


@pytest.mark.parametrize("world_size", [pytest.param(1, marks=pytest.mark.slow), 2, 4])
def test_ranks_all_reduce_and_see_their_environment(launcher, out_dir, tmp_path, world_size):
    port = launcher.free_port()
    (tmp_path / ".deepspeed_env").write_text("DSTEST_FROM_FILE=from file\n")
    env = launcher.env(CUDA_VISIBLE_DEVICES="", NCCL_DSTEST="1", HOME=str(tmp_path / "home"))
    result = launcher.run(
        f"--num_gpus={world_size}",
        f"--master_port={port}",
        *launcher.program("allreduce", out_dir),
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    expected_sum = float(sum(range(world_size)))
    for rank, res in enumerate(_results(out_dir, world_size)):
        assert res["sum"] == expected_sum
        assert res["launch"] == [rank, world_size, rank, "torchrun"]
        assert res["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "CROSS_RANK": "0",
            "CROSS_SIZE": "1",
            "CUDA_VISIBLE_DEVICES": "",  # CPU ranks: the launcher's own value, untouched
            "OMP_NUM_THREADS": "1",
        }
        assert res["local_rank_args"] == [f"--local_rank={rank}"]
        assert res["dstest"] == {"NCCL_DSTEST": "1", "DSTEST_FROM_FILE": "from file"}
        assert f"[rank{rank}] rank {rank} done" in result.stdout.splitlines()
        assert f"[rank{rank}] rank {rank} to stderr" in result.stderr.splitlines()


def test_without_gpus_one_cpu_rank_is_started_with_a_hint(launcher, out_dir, tmp_path):
    result = launcher.run(
        *launcher.program("report", out_dir),
        cwd=tmp_path,
        env=launcher.env(CUDA_VISIBLE_DEVICES=""),
    )
    assert result.returncode == 0, result.stderr
    assert "no GPU found: starting 1 CPU rank (pass --num_gpus N" in result.stderr
    (res,) = _results(out_dir, 1)
    assert res["env"]["WORLD_SIZE"] == "1"


def test_visible_gpus_become_slots_and_each_node_sees_its_own(launcher, out_dir, tmp_path):
    # No GPU is touched: the report mode only reads the environment.
    env = launcher.env(CUDA_VISIBLE_DEVICES="5,7")
    result = launcher.run(*launcher.program("report", out_dir), cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    for rank, res in enumerate(_results(out_dir, 2)):
        assert res["env"]["CUDA_VISIBLE_DEVICES"] == "5,7"
        assert res["env"]["LOCAL_RANK"] == str(rank)
    result = launcher.run(
        "--include=localhost:7", *launcher.program("report", tmp_path), cwd=tmp_path, env=env
    )
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "rank0.json").read_text())["env"]["CUDA_VISIBLE_DEVICES"] == "7"


def test_each_rank_log_save_pid_and_no_local_rank(launcher, out_dir, tmp_path):
    logs = tmp_path / "logs"
    result = launcher.run(
        "--num_gpus=2",
        f"--enable_each_rank_log={logs}",
        "--save_pid",
        "--no_local_rank",
        *launcher.program("report", out_dir),
        cwd=tmp_path,
        env=launcher.env(CUDA_VISIBLE_DEVICES=""),
    )
    assert result.returncode == 0, result.stderr
    for rank, res in enumerate(_results(out_dir, 2)):
        (log,) = logs.glob(f"*_rank{rank}.log")
        assert log.read_text().splitlines() == [f"rank {rank} done", f"rank {rank} to stderr"]
        assert res["local_rank_args"] == []
        # The agent runs inside ds-launch: the pid file names it, and it is gone afterwards.
        assert res["pid_file"] == str(res["ppid"])
        assert not Path(f"/tmp/{res['ppid']}.deepspeed").exists()
    assert "[rank1] rank 1 done" in result.stdout


def test_module_and_no_python(launcher, out_dir, tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "report.py").write_text(launcher.program_path.read_text())
    env = launcher.env(CUDA_VISIBLE_DEVICES="")
    result = launcher.run(
        "--num_gpus=2", "--module", "pkg.report", *launcher.program("report", out_dir)[1:],
        cwd=tmp_path, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert [r["local_rank_args"] for r in _results(out_dir, 2)] == [
        ["--local_rank=0"],
        ["--local_rank=1"],
    ]
    script = tmp_path / "run.sh"
    script.write_text('#!/bin/sh\necho "shell rank $RANK of $WORLD_SIZE: $*"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    result = launcher.run("--num_gpus=2", "--no_python", str(script), "x", cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert "[rank1] shell rank 1 of 2: --local_rank=1 x" in result.stdout.splitlines()


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs sched_setaffinity")
def test_bind_cores_to_rank_pins_each_rank_to_its_share(launcher, out_dir, tmp_path):
    cores = sorted(os.sched_getaffinity(0))
    ranks = min(2, len(cores))
    share = len(cores) // ranks
    result = launcher.run(
        f"--num_gpus={ranks}",
        "--bind_cores_to_rank",
        f"--bind_core_list={','.join(map(str, cores))}",
        *launcher.program("report", out_dir),
        cwd=tmp_path,
        env=launcher.env(CUDA_VISIBLE_DEVICES=""),
    )
    assert result.returncode == 0, result.stderr
    for rank, res in enumerate(_results(out_dir, ranks)):
        assert res["affinity"] == cores[rank * share : (rank + 1) * share]
        assert res["env"]["OMP_NUM_THREADS"] == str(share)
