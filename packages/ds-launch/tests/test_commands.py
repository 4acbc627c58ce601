"""The command line each runner builds, against the expected argv (slurm, impi and mvapich are
only checked here; pdsh, ssh and mpich also run for real in the other tests)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import pytest

from ds_launch import LaunchConfig, LaunchError, plan_launch
from ds_launch._nodespec import decode_world_info

PY = sys.executable
ENV = {"NCCL_DEBUG": "INFO", "UNRELATED": "x", "RANK": "9", "PATH": "/usr/bin"}


@pytest.fixture
def hostfile(tmp_path: Path) -> str:
    path = tmp_path / "hostfile"
    path.write_text("w1 slots=4\nw2 slots=4\n")
    return str(path)


def _plan(hostfile: str, cwd: Path, monkeypatch, **kwargs):
    monkeypatch.setenv("HOME", str(cwd / "home"))  # no ~/.deepspeed_env of the test machine
    kwargs = {"user_script": "train.py", "user_args": ("--lr", "0.1"), **kwargs}
    config = LaunchConfig(hostfile=hostfile, **kwargs)
    return plan_launch(config, ENV, cwd=str(cwd))


def _tool(plan) -> tuple[str, list[str]]:
    (argv,) = plan.commands
    return Path(argv[0]).name, list(argv[1:])


def test_mpich_impi_mvapich_use_genv_hosts_and_ppn(hostfile, tmp_path, monkeypatch):
    exports = ["-genv", "NCCL_DEBUG", "INFO", "-genv", "PYTHONPATH", str(tmp_path)]
    master = ["-genv", "MASTER_ADDR", "w1", "-genv", "MASTER_PORT", "29500"]
    head = ["-n", "8", "-ppn", "4", "-hosts", "w1,w2"]
    program = [PY, "-u", "train.py", "--lr", "0.1"]
    for launcher in ("mpich", "impi"):
        plan = _plan(hostfile, tmp_path, monkeypatch, launcher=launcher)
        assert _tool(plan) == ("mpirun", [*head, *exports, *master, *program])
    plan = _plan(hostfile, tmp_path, monkeypatch, launcher="mvapich", launcher_args="-verbose")
    mv2 = [
        ("MV2_SMP_USE_CMA", "0"),
        ("MV2_DEBUG_SHOW_BACKTRACE", "1"),
        ("MV2_SUPPORT_DL", "1"),
        ("MV2_ENABLE_AFFINITY", "0"),
        ("MV2_INTER_ALLGATHER_TUNING", "5"),
        ("MV2_CUDA_USE_NAIVE", "0"),
        ("MV2_USE_CUDA", "1"),
    ]
    mv2_args = [word for name, value in mv2 for word in ("-genv", name, value)]
    assert _tool(plan) == ("mpirun", [*head, "-verbose", *exports, *mv2_args, *master, *program])
    assert [(n.host, [r.rank for r in n.ranks]) for n in plan.nodes] == [
        ("w1", [0, 1, 2, 3]),
        ("w2", [4, 5, 6, 7]),
    ]


def test_openmpi_writes_a_hostfile_of_the_selection(hostfile, tmp_path, monkeypatch):
    plan = _plan(hostfile, tmp_path, monkeypatch, launcher="openmpi", num_gpus=2, module=True)
    (path, text), = plan.files.items()  # fmt: skip
    assert text == "w1 slots=2\nw2 slots=2\n"
    exports = ["-x", "NCCL_DEBUG=INFO", "-x", f"PYTHONPATH={tmp_path}"]
    master = ["-x", "MASTER_ADDR=w1", "-x", "MASTER_PORT=29500"]
    program = [PY, "-u", "-m", "train.py", "--lr", "0.1"]
    assert _tool(plan) == ("mpirun", ["-n", "4", "--hostfile", path, *exports, *master, *program])


def test_slurm_uses_srun_export_nodelist_and_tasks_per_node(hostfile, tmp_path, monkeypatch):
    (tmp_path / ".deepspeed_env").write_text("NCCL_IB_HCA=mlx5_0,mlx5_1\n")
    plan = _plan(
        hostfile,
        tmp_path,
        monkeypatch,
        launcher="slurm",
        include="w1:2,3@w2:2,3",
        master_addr="10.0.0.1",
        master_port=1234,
        launcher_args="--partition=gpu --exclusive",
    )
    exports = f"ALL,NCCL_DEBUG=INFO,PYTHONPATH={tmp_path},MASTER_ADDR=10.0.0.1,"
    exports += "MASTER_PORT=1234,NCCL_IB_HCA,CUDA_VISIBLE_DEVICES"
    assert _tool(plan) == (
        "srun",
        [
            *("-n", "4", "--nodes=2", "--ntasks-per-node=2", "--nodelist=w1,w2"),
            *("--partition=gpu", "--exclusive", f"--export={exports}"),
            *(PY, "-u", "train.py", "--lr", "0.1"),
        ],
    )
    # A value holding a comma cannot be written inside --export: it travels in srun's env.
    assert plan.tool_env == {"NCCL_IB_HCA": "mlx5_0,mlx5_1", "CUDA_VISIBLE_DEVICES": "2,3"}


def test_mpi_runners_refuse_what_they_cannot_express(hostfile, tmp_path, monkeypatch):
    with pytest.raises(LaunchError, match=r"same number of ranks on every node.*w1: 1, w2: 4"):
        _plan(hostfile, tmp_path, monkeypatch, launcher="mpich", include="w1:0@w2")
    with pytest.raises(LaunchError, match=r"own GPU list .*w1: 0,1; w2: 2,3"):
        _plan(hostfile, tmp_path, monkeypatch, launcher="impi", include="w1:0,1@w2:2,3")
    with pytest.raises(LaunchError, match="--bind_cores_to_rank, --save_pid need"):
        _plan(
            hostfile,
            tmp_path,
            monkeypatch,
            launcher="slurm",
            bind_cores_to_rank=True,
            save_pid=True,
        )


def test_pdsh_runs_the_agent_on_every_node(hostfile, tmp_path, monkeypatch):
    plan = _plan(
        hostfile, tmp_path, monkeypatch, ssh_port=2222, launcher_args="-t 5", user_args=("50%",)
    )
    tool, args = _tool(plan)
    assert tool == "pdsh"
    assert args[:6] == ["-S", "-f", "1024", "-w", "w1,w2", "-t"]
    remote = args[7]
    assert len(args) == 8
    cd, _, command = remote.partition(" && exec ")
    assert cd == f"cd {shlex.quote(str(tmp_path))}"
    words = shlex.split(command)
    assert " --node_host='%h' " in command  # quoted: see test_injection.py
    assert words[:3] == ["env", "NCCL_DEBUG=INFO", f"PYTHONPATH={tmp_path}"]
    # pdsh substitutes %h with each node's name and %% with %.
    assert words[3:8] == [PY, "-u", "-m", "ds_launch.node", words[7]]
    assert words[8:] == [
        "--node_host=%h",
        "--master_addr=w1",
        "--master_port=29500",
        "--report_events",  # the launcher watches each node (see test_liveness.py)
        "train.py",
        "50%%",
    ]
    assert decode_world_info(words[7].removeprefix("--world_info=")) == {
        "w1": [0, 1, 2, 3],
        "w2": [0, 1, 2, 3],
    }
    assert plan.tool_env == {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": "-p 2222"}
    assert [n.command[-6:] for n in plan.nodes] == [
        (
            "--node_rank=0",
            "--master_addr=w1",
            "--master_port=29500",
            "--report_events",
            "train.py",
            "50%",
        ),
        (
            "--node_rank=1",
            "--master_addr=w1",
            "--master_port=29500",
            "--report_events",
            "train.py",
            "50%",
        ),
    ]
    assert plan.nodes[1].ranks[2].command == (PY, "-u", "train.py", "--local_rank=2", "50%")


def test_ssh_runs_one_client_per_node_with_the_users_options_first(hostfile, tmp_path, monkeypatch):
    plan = _plan(
        hostfile, tmp_path, monkeypatch, launcher="ssh", ssh_port=2222,
        launcher_args="-i /k -o ConnectTimeout=5", exclude="w1:3", no_local_rank=True,
    )  # fmt: skip
    assert len(plan.commands) == 2
    for node_rank, (host, argv) in enumerate(zip(("w1", "w2"), plan.commands)):
        assert Path(argv[0]).name == "ssh"
        options = ["-i", "/k", "-o", "ConnectTimeout=5", "-T", "-o", "BatchMode=yes"]
        assert list(argv[1:-1]) == [*options, "-p", "2222", "--", host]
        remote = shlex.split(argv[-1].partition(" && exec ")[2])
        assert f"--node_rank={node_rank}" in remote
        assert remote[-5:] == ["--no_local_rank", "--report_events", "train.py", "--lr", "0.1"]
    assert [list(n.slots) for n in plan.nodes] == [[0, 1, 2], [0, 1, 2, 3]]
    assert plan.world_size == 7


def test_one_node_runs_locally_unless_forced(hostfile, tmp_path, monkeypatch):
    plan = _plan(hostfile, tmp_path, monkeypatch, num_nodes=1)
    assert plan.launcher == "local"
    assert plan.master_addr == "127.0.0.1"
    assert "PYTHONPATH" not in plan.exports  # only multi-node runs prepend the launch directory
    forced = _plan(hostfile, tmp_path, monkeypatch, num_nodes=1, force_multi=True)
    assert forced.launcher == "pdsh"
    assert forced.master_addr == "w1"
    with pytest.raises(LaunchError, match="--launcher local runs on this machine only"):
        _plan(hostfile, tmp_path, monkeypatch, launcher="local")
