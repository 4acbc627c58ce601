"""``ds_launch.runner`` and ``ds_launch.node``: the names of DeepSpeed's
``deepspeed.launcher.runner`` and ``deepspeed.launcher.launch``, with DeepSpeed's values and
meanings, and the ``.deepspeed_env`` file they point at really read by the launcher (as
``accelerate launch`` relies on)."""

from __future__ import annotations

import base64
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ds_launch import LaunchConfig, node, plan_launch, runner


def test_constants_have_deepspeeds_values():
    assert os.environ.get("DS_ENV_FILE", ".deepspeed_env") == runner.DEEPSPEED_ENVIRONMENT_NAME
    assert [os.path.expanduser("~"), "."] == runner.DEEPSPEED_ENVIRONMENT_PATHS
    assert runner.PDSH_MAX_FAN_OUT == 1024
    assert runner.DLTS_HOSTFILE == "/job/hostfile"
    assert runner.TORCH_DISTRIBUTED_DEFAULT_PORT == node.TORCH_DISTRIBUTED_DEFAULT_PORT == 29500
    assert runner.EXCLUDE_ENVS == {"AISC_JOB_NAME": ["NCCL_IB_HCA", "UCX_NET_DEVICES"]}
    launchers = [runner.PDSH_LAUNCHER, runner.OPENMPI_LAUNCHER, runner.MPICH_LAUNCHER,
                 runner.IMPI_LAUNCHER, runner.SLURM_LAUNCHER, runner.MVAPICH_LAUNCHER]  # fmt: skip
    assert launchers == ["pdsh", "openmpi", "mpich", "impi", "slurm", "mvapich"]
    for name in launchers:  # each is a --launcher ds-launch takes
        LaunchConfig(user_script="t.py", launcher=name)
    assert (node.CROSS_RANK, node.CROSS_SIZE, node.PID_FILE_BASEPATH) == (
        "CROSS_RANK",
        "CROSS_SIZE",
        "/tmp",
    )
    # DeepSpeed's prefixes (its accelerator adds NCCL), each exported by ds-launch.
    for prefix in ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL"):
        assert any(name.startswith(prefix) for name in runner.EXPORT_ENVS), prefix


def test_environment_name_follows_ds_env_file_at_import(tmp_path):
    code = "from ds_launch.runner import DEEPSPEED_ENVIRONMENT_NAME as N; print(N)"
    env = {**os.environ, "DS_ENV_FILE": "job.env"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip() == "job.env", result.stderr


def test_the_file_accelerate_appends_to_reaches_every_rank(tmp_path, monkeypatch):
    # What `accelerate launch` does for a multi-node DeepSpeed job, then the launch it starts.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("DS_ENV_FILE", raising=False)
    with open(".deepspeed_env", "a") as fd:
        fd.writelines(["ACCELERATE_MIXED_PRECISION=bf16\n", "ACCELERATE_USE_DEEPSPEED=true\n"])
    hostfile = tmp_path / "hosts"
    hostfile.write_text("w1 slots=1\nw2 slots=1\n")
    config = LaunchConfig(user_script="train.py", hostfile=str(hostfile), no_local_rank=True)
    plan = plan_launch(config, {}, cwd=str(tmp_path))
    assert plan.exports["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert plan.exports["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert "ACCELERATE_USE_DEEPSPEED=true" in plan.commands[0][-1]  # in pdsh's remote command


def test_fetch_hostfile_counts_slots_or_returns_none(tmp_path):
    assert runner.fetch_hostfile(str(tmp_path / "missing")) is None
    path = tmp_path / "hosts"
    path.write_text("worker-0 slots=4\n# spare\nworker-1 slots=2\n")
    pool = runner.fetch_hostfile(str(path))
    assert pool == collections.OrderedDict([("worker-0", 4), ("worker-1", 2)])
    assert isinstance(pool, collections.OrderedDict)
    path.write_text("worker-0 slots=4\nworker-0 slots=2\n")
    with pytest.raises(ValueError, match="worker-0"):
        runner.fetch_hostfile(str(path))


def test_resource_filters_as_deepspeed_documents_them():
    pool = collections.OrderedDict([("worker-0", 4), ("worker-1", 4)])
    assert runner.parse_inclusion_exclusion(pool, "worker-0@worker-1:0,2", "") == {
        "worker-0": [0, 1, 2, 3],
        "worker-1": [0, 2],
    }
    assert runner.parse_inclusion_exclusion(pool, "", "worker-1:0") == {
        "worker-0": [0, 1, 2, 3],
        "worker-1": [1, 2, 3],
    }
    assert runner.parse_inclusion_exclusion(pool, "", "worker-0") == {"worker-1": [0, 1, 2, 3]}
    # Hosts keep the pool's order whatever the order written.
    hosts = runner.parse_resource_filter({"a": [0], "b": [0]}, include_str="b@a")
    assert list(hosts) == ["a", "b"]
    assert isinstance(hosts, collections.OrderedDict)
    assert runner.parse_resource_filter({"a": [0, 1]}) == {"a": [0, 1]}


@pytest.mark.parametrize(
    ("include", "exclude", "message"),
    [
        ("a", "b", "mutually exclusive"),
        ("nope", "", "'nope' is not in"),
        ("a:7", "", "slot(s) 7 not on host 'a'"),
        ("a:x", "", "not a number"),
    ],
)
def test_resource_filter_errors_are_value_errors(include, exclude, message):
    with pytest.raises(ValueError) as info:
        runner.parse_resource_filter({"a": [0, 1], "b": [0]}, include, exclude)
    assert message in str(info.value)


def test_encode_world_info_is_base64_json_the_agent_reads():
    world = {"worker-0": [0, 1], "worker-1": [2]}
    text = runner.encode_world_info(world)
    assert json.loads(base64.urlsafe_b64decode(text)) == world
    from ds_launch._nodespec import decode_world_info

    assert decode_world_info(text) == world


def test_parse_args_has_deepspeeds_attributes():
    args = runner.parse_args(["--num_gpus", "2", "--no_ssh", "--node_rank=0", "t.py", "--x"])
    assert (args.num_gpus, args.no_ssh, args.node_rank) == (2, True, 0)
    assert (args.user_script, args.user_args) == ("t.py", ["--x"])
    for name in ("hostfile", "include", "exclude", "num_nodes", "master_port", "master_addr",
                 "launcher", "launcher_args", "module", "no_python", "no_local_rank",
                 "no_ssh_check", "force_multi", "save_pid", "enable_each_rank_log",
                 "bind_cores_to_rank", "bind_core_list", "ssh_port", "venv_script", "log_level",
                 "quiet", "autotuning"):  # fmt: skip
        assert hasattr(args, name), name


def test_main_returns_none_on_success_and_exits_with_the_jobs_code(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("HOME", str(tmp_path))
    ok = Path(tmp_path / "ok.py")
    ok.write_text("")
    assert runner.main(["-q", "--no_local_rank", str(ok)]) is None
    failing = Path(tmp_path / "fail.py")
    failing.write_text("raise SystemExit(4)\n")
    with pytest.raises(SystemExit) as info:
        runner.main(["-q", "--no_local_rank", str(failing)])
    assert info.value.code == 4
    with pytest.raises(SystemExit) as info:
        runner.main(["-q", "--bogus_flag", "t.py"])
    assert info.value.code == 2


def test_launch_parse_args_has_deepspeeds_attributes():
    args = node.parse_args(["--world_info=e30=", "--node_rank=1", "-q", "train.py", "--lr", "1"])
    assert (args.node_rank, args.master_addr, args.master_port) == (1, "127.0.0.1", 29500)
    assert (args.training_script, args.training_script_args) == ("train.py", ["--lr", "1"])
    assert (args.quiet, args.log_level, args.save_pid) == (True, "info", 0)
    assert args.enable_each_rank_log == "None"


def test_terminate_process_tree_stops_a_process_and_its_children(tmp_path):
    ready = tmp_path / "ready"
    code = (
        "import subprocess, sys, time, pathlib; "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"pathlib.Path({str(ready)!r}).write_text('1'); time.sleep(600)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code])
    while not ready.exists():
        assert parent.poll() is None
    from ds_launch._supervise import descendants

    (child,) = descendants({parent.pid})
    node.terminate_process_tree(parent.pid)
    assert parent.wait(timeout=30) == -15  # SIGTERM
    assert not os.path.exists(f"/proc/{child}") or "Z" in Path(f"/proc/{child}/stat").read_text()
