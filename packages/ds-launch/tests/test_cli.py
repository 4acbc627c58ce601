"""The ``ds-launch`` command line: a fast start without torch, ``--dry_run``, and usage errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ds_launch.cli import _attach_launcher_args, build_parser, config_from_args, main


def test_help_imports_no_torch_and_no_other_ds_package():
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ds_launch.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "--num_gpus NUM_GPUS, --num_accelerators NUM_GPUS" in result.stdout
    imported = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines()]
    heavy = [m for m in imported if m.split(".")[0] in ("torch", "numpy", "ds_comm", "ds_engine")]
    assert imported and not heavy, heavy


def test_dry_run_prints_every_node_and_runs_nothing(launcher, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\n")
    result = launcher.run(
        f"-H={hostfile}", "--launcher=ssh", "--dry_run", "--exclude=node-b:0",
        "does_not_exist.py", "--lr", "1",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert (plan["launcher"], plan["world_size"], plan["master_addr"]) == ("ssh", 3, "node-a")
    assert [(n["host"], n["slots"]) for n in plan["nodes"]] == [("node-a", [0, 1]), ("node-b", [1])]
    assert [r["rank"] for r in plan["nodes"][1]["ranks"]] == [2]
    assert plan["nodes"][1]["ranks"][0]["command"][-4:] == [
        "does_not_exist.py",
        "--local_rank=0",
        "--lr",
        "1",
    ]
    assert [c[-2] for c in plan["commands"]] == ["node-a", "node-b"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-H", "/nonexistent/hosts", "t.py"], "hostfile /nonexistent/hosts does not exist"),
        (["--autotuning", "run", "t.py"], "--autotuning is a DeepSpeed flag ds-launch does not"),
        (["-i", "localhost", "--num_gpus", "1", "t.py"], "cannot be combined with --num_nodes"),
        (["--launcher", "nope", "t.py"], "--launcher nope: unknown launcher"),
        (["--num_gpus", "2", "--include", "localhost:3", "t.py"], "cannot be combined"),
    ],
)
def test_usage_errors_exit_2_with_the_reason(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds-launch: error: ")
    assert message in err


def test_launcher_args_may_start_with_a_dash():
    parser = build_parser()
    for argv in (
        ["--launcher_args", "-i key -p 22", "t.py", "--launcher_args", "user"],
        ["--launcher_args=-i key -p 22", "t.py", "--launcher_args", "user"],
    ):
        config = config_from_args(parser.parse_args(_attach_launcher_args(parser, argv)))
        assert config.launcher_args == "-i key -p 22"
        assert config.user_args == ("--launcher_args", "user")


def test_node_agent_rejects_a_bad_world_info():
    agent = [sys.executable, "-m", "ds_launch.node", "--world_info=bm9wZQ==", "--node_rank=0"]
    result = subprocess.run(
        [*agent, "--master_addr=a", "--master_port=1", "t.py"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "ds-launch node: error: --world_info is not a ds-launch world info" in result.stderr
