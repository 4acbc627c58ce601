"""The ``ds-launch`` command line: a fast start without torch, ``--dry_run``, DeepSpeed's flags
(each taken or refused by name, never by abbreviation), and usage errors."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from ds_launch.cli import (
    _SWITCHES,
    _UNSUPPORTED,
    _attach_launcher_args,
    build_parser,
    config_from_args,
    main,
)

# Every flag of DeepSpeed 0.19.8's `deepspeed` command (deepspeed/launcher/runner.py parse_args).
DEEPSPEED_FLAGS = (
    "-H", "--hostfile", "-i", "--include", "-e", "--exclude", "--num_nodes", "--num_gpus",
    "--num_accelerators", "--master_port", "--master_addr", "--node_rank", "--launcher",
    "--launcher_args", "--module", "--no_python", "--no_local_rank", "--no_ssh", "--no_ssh_check",
    "--force_multi", "--save_pid", "--enable_each_rank_log", "--autotuning",
    "--bind_cores_to_rank", "--bind_core_list", "--ssh_port", "--venv_script", "--log_level",
    "-q", "--quiet",
)  # fmt: skip


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


def test_every_deepspeed_flag_is_taken_or_refused_by_name():
    parser = build_parser()
    known = set(parser._option_string_actions)
    assert [flag for flag in DEEPSPEED_FLAGS if flag not in known] == []
    refused = [flag for flag in DEEPSPEED_FLAGS if flag in _UNSUPPORTED]
    assert refused == []  # --autotuning hands off to ds-engine's ds-autotune


@pytest.mark.skipif(
    importlib.util.find_spec("ds_engine") is not None,
    reason="ds-engine is installed: ds-autotune runs (ds-engine's test_autotuning covers it)",
)
def test_autotuning_without_ds_engine_names_the_package_it_needs(capfd):
    # ds-launch alone (its own venv): the hand-off to ds-autotune needs ds-engine
    assert main(["--autotuning", "tune", "--num_gpus", "2", "t.py", "--lr", "1"]) == 2
    assert "ds-launch: error: --autotuning needs ds-engine installed" in capfd.readouterr().err


@pytest.mark.parametrize("flag", sorted(_UNSUPPORTED))
def test_refused_flags_say_not_implemented_and_what_to_do(flag, capsys):
    assert main([flag, *([] if flag in _SWITCHES else ["1"]), "t.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ds-launch: error: {flag} is not implemented by ds-launch: ")
    assert len(err.split(": ", 3)[-1].strip()) > 20, err  # the alternative, not just "no"


@pytest.mark.parametrize(
    "argv",
    [
        ["--no_ss", "t.py"],  # once silently --no_ssh_check
        ["--master_p", "1234", "t.py"],
        ["--num_gpu", "2", "t.py"],
        ["--log", "debug", "t.py"],
    ],
)
def test_abbreviated_flags_are_rejected(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert f"unrecognized arguments: {argv[0]}" in capsys.readouterr().err


def test_no_ssh_is_its_own_flag_and_quiet_means_log_level_error():
    parser = build_parser()
    args = parser.parse_args(["--no_ssh", "--node_rank", "0", "-q", "t.py"])
    config = config_from_args(args)
    assert (config.no_ssh, config.node_rank, config.log_level) == (True, 0, "error")
    assert not args.no_ssh_check
    config = config_from_args(parser.parse_args(["--log_level", "debug", "t.py"]))
    assert (config.no_ssh, config.node_rank, config.log_level) == (False, -1, "debug")
    config = config_from_args(parser.parse_args(["--quiet", "--log_level", "debug", "t.py"]))
    assert config.log_level == "error"  # as in DeepSpeed, -q wins


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--node_rank", "1", "t.py"], "--node_rank 1 is only used with --no_ssh"),
        (["--no_ssh", "t.py"], "--no_ssh needs --node_rank N"),
        (["--no_ssh", "--node_rank", "1", "t.py"], "--node_rank 1: the job has 1 node(s)"),
        (["--no_ssh", "--node_rank", "0", "--force_multi", "t.py"], "pick one"),
        (["--no_ssh", "--node_rank", "0", "--launcher", "slurm", "t.py"], "--launcher slurm"),
        (["--venv_script", "missing/activate", "t.py"], "--venv_script missing/activate: no such"),
    ],
)
def test_node_option_errors_name_the_flag_and_the_fix(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert main(["--dry_run", *argv]) == 2
    assert message in capsys.readouterr().err


def test_node_agent_takes_deepspeed_launch_flags_and_refuses_abbreviations():
    from ds_launch._nodespec import encode_world_info, parse_node_argv

    world = encode_world_info({"localhost": [0, 1]})
    spec = parse_node_argv(
        [f"--world_info={world}", "--save_pid", "0", "--enable_each_rank_log", "None", "-q",
         "t.py", "--x"]
    )  # fmt: skip
    assert (spec.node_rank, spec.master_addr, spec.master_port) == (0, "127.0.0.1", 29500)
    assert (spec.save_pid, spec.enable_each_rank_log, spec.log_level) == (None, None, "error")
    assert spec.user_args == ("--x",)
    with pytest.raises(SystemExit):
        parse_node_argv([f"--world_info={world}", "--node_r=1", "t.py"])
