"""DeepSpeed 0.19's newer launcher flags: ``--no_ssh``/``--node_rank`` (each node started on its
own), ``--venv_script``, ``--log_level``/``-q``, and the per-node agent run the way DeepSpeed's
``deepspeed.launcher.launch`` is. Plans first, then real launches through the ``ds-launch``
script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ds_launch import LaunchConfig, plan_launch
from ds_launch._nodespec import encode_world_info

ENV = {"NCCL_DEBUG": "INFO", "PYTHONPATH": "/opt/lib", "PATH": "/usr/bin"}


def _hosts(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hosts"
    path.write_text(text)
    return str(path)


def _plan(tmp_path: Path, monkeypatch, **kwargs):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.deepspeed_env of the machine
    config = LaunchConfig(user_script="train.py", user_args=("--lr", "1"), **kwargs)
    return plan_launch(config, ENV, cwd=str(tmp_path))


def test_no_ssh_plans_only_this_node_of_the_job(tmp_path, monkeypatch):
    hostfile = _hosts(tmp_path, "w1 slots=2\nw2 slots=2\nw3 slots=2\n")
    plan = _plan(tmp_path, monkeypatch, hostfile=hostfile, no_ssh=True, node_rank=1)
    assert (plan.launcher, plan.world_size, plan.master_addr) == ("local", 6, "w1")
    (command,) = plan.commands
    assert command == plan.nodes[1].command
    assert "--node_rank=1" in command
    assert [r.rank for r in plan.nodes[1].ranks] == [2, 3]
    assert plan.exports["PYTHONPATH"] == "/opt/lib"  # ranks run here: no launch dir added


def test_venv_script_wraps_every_rank_command_on_every_runner(tmp_path, monkeypatch):
    (tmp_path / "activate").write_text("export X=1\n")
    plan = _plan(tmp_path, monkeypatch, venv_script="activate", num_gpus=1)
    wrapped = ("/bin/sh", "-c", '. "$0" && exec "$@"', "./activate", sys.executable, "-u")
    assert plan.nodes[0].ranks[0].command[:6] == wrapped
    hostfile = _hosts(tmp_path, "w1 slots=1\nw2 slots=1\n")
    for launcher in ("pdsh", "ssh"):  # the agent gets it, and sources it for each rank
        plan = _plan(tmp_path, monkeypatch, hostfile=hostfile, launcher=launcher,
                     venv_script="/opt/venv/bin/activate")  # fmt: skip
        assert "--venv_script=/opt/venv/bin/activate" in " ".join(plan.commands[0])
        assert plan.nodes[1].ranks[0].command[3] == "/opt/venv/bin/activate"
    plan = _plan(tmp_path, monkeypatch, hostfile=hostfile, launcher="openmpi",
                 venv_script="/opt/venv/bin/activate")  # fmt: skip
    (argv,) = plan.commands
    program = argv[argv.index("/bin/sh") :]
    assert program == (*wrapped[:3], "/opt/venv/bin/activate", sys.executable, "-u", "train.py",
                       "--lr", "1")  # fmt: skip


def test_log_level_travels_to_remote_agents(tmp_path, monkeypatch):
    hostfile = _hosts(tmp_path, "w1 slots=1\nw2 slots=1\n")
    plan = _plan(tmp_path, monkeypatch, hostfile=hostfile, launcher="ssh", log_level="error")
    assert all("--log_level=error" in argv[-1] for argv in plan.commands)
    plan = _plan(tmp_path, monkeypatch, hostfile=hostfile, launcher="ssh")
    assert not any("--log_level" in argv[-1] for argv in plan.commands)


def _results(out_dir: Path, world_size: int) -> list[dict]:
    files = sorted(out_dir.glob("rank*.json"))
    assert len(files) == world_size, [f.name for f in files]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def test_no_ssh_nodes_started_separately_form_one_job(launcher, out_dir, tmp_path):
    # Two host names of this machine stand for two nodes; each "node" is its own ds-launch.
    hostfile = _hosts(tmp_path, "localhost slots=1\n127.0.0.1 slots=1\n")
    port = launcher.free_port()
    env = launcher.env(HOME=str(tmp_path))
    flags = [f"--hostfile={hostfile}", "--no_ssh", "--master_addr=127.0.0.1"]
    program = [f"--master_port={port}", *launcher.program("allreduce", out_dir)]
    procs = [
        launcher.start(*flags, f"--node_rank={node}", *program, cwd=tmp_path, env=env)
        for node in (0, 1)
    ]
    outputs = [proc.communicate(timeout=240) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    for node, res in enumerate(_results(out_dir, 2)):
        assert res["sum"] == 1.0
        assert res["launch"] == [node, 2, 0, "torchrun"]
        assert (res["env"]["CROSS_RANK"], res["env"]["CROSS_SIZE"]) == (str(node), "2")
        assert res["env"]["CUDA_VISIBLE_DEVICES"] == "0"  # the hostfile's slot on that node


def test_venv_script_is_sourced_by_every_rank(launcher, out_dir, tmp_path):
    (tmp_path / "activate").write_text('export DSTEST_VENV="sourced $RANK"\n')
    result = launcher.run(
        "--num_gpus=2", "--venv_script=activate", *launcher.program("report", out_dir),
        cwd=tmp_path, env=launcher.env(CUDA_VISIBLE_DEVICES=""),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for rank, res in enumerate(_results(out_dir, 2)):
        assert res["dstest"] == {"DSTEST_VENV": f"sourced {rank}"}


def _launcher_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("ds-launch: ")]


def test_log_level_and_quiet_choose_the_launcher_messages(launcher, out_dir, tmp_path):
    env = launcher.env(CUDA_VISIBLE_DEVICES="")  # one CPU rank, with the no-GPU warning
    program = launcher.program("report", out_dir)
    default = _launcher_lines(launcher.run(*program, cwd=tmp_path, env=env).stderr)
    assert default[0].startswith("ds-launch: no GPU found: starting 1 CPU rank")
    assert any(line.startswith("ds-launch: local launch of 1 rank(s)") for line in default)
    assert any(line.startswith("ds-launch: cmd = ") for line in default)
    assert any(line.startswith("ds-launch: node 0 (localhost) of 1") for line in default)
    assert not any("RANK=0" in line for line in default)
    debug = launcher.run("--log_level=debug", *program, cwd=tmp_path, env=env).stderr
    assert any("RANK=0 LOCAL_RANK=0" in line for line in _launcher_lines(debug))
    warning = launcher.run("--log_level=warning", *program, cwd=tmp_path, env=env).stderr
    assert _launcher_lines(warning) == [default[0]]
    for quiet in ("-q", "--quiet", "--log_level=error"):
        result = launcher.run(quiet, *program, cwd=tmp_path, env=env)
        assert result.returncode == 0, result.stderr
        assert _launcher_lines(result.stderr) == []
        assert "[rank0] rank 0 to stderr" in result.stderr.splitlines()  # never filtered


def test_quiet_still_reports_a_failure_and_critical_does_not(launcher, out_dir, tmp_path):
    env = launcher.env(CUDA_VISIBLE_DEVICES="")
    program = launcher.program("hang", out_dir, "crash=0:3")
    result = launcher.run("-q", *program, cwd=tmp_path, env=env)
    assert result.returncode == 3
    (report,) = _launcher_lines(result.stderr)
    assert report.startswith("ds-launch: rank 0 on localhost (pid ")
    for path in out_dir.iterdir():
        path.unlink()
    result = launcher.run("--log_level=critical", *program, cwd=tmp_path, env=env)
    assert result.returncode == 3
    assert _launcher_lines(result.stderr) == []
    launcher.assert_no_leftovers()


def test_agent_runs_like_deepspeeds_per_node_launcher(launcher, out_dir, tmp_path):
    world = encode_world_info({"localhost": [0, 1]})
    command = [sys.executable, "-m", "ds_launch.node", f"--world_info={world}", "-q"]
    result = subprocess.run(
        [*command, *launcher.program("report", out_dir)],
        cwd=tmp_path, env=launcher.env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert _launcher_lines(result.stderr) == []
    for rank, res in enumerate(_results(out_dir, 2)):
        assert res["env"]["MASTER_ADDR"] == "127.0.0.1"  # DeepSpeed's launch.py defaults
        assert res["env"]["MASTER_PORT"] == "29500"
        assert res["env"]["CROSS_RANK"] == "0"
        assert res["env"]["CUDA_VISIBLE_DEVICES"] == "0,1"
        assert res["local_rank_args"] == [f"--local_rank={rank}"]
