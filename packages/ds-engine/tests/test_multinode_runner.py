"""``deepspeed.launcher.multinode_runner``: DeepSpeed's runner classes give the command ds-launch
starts for their launcher, with DeepSpeed's constructors, exports and resource checks."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from ds_engine.launcher import multinode_runner as mr
from ds_engine.launcher.runner import encode_world_info, parse_args

RESOURCES = {"w1": [0, 1], "w2": [0, 1]}
POOL = {"w1": 2, "w2": 2}


def _runner(cls: type, *argv: str) -> mr.MultiNodeRunner:
    args = parse_args([*argv, "train.py", "--lr", "a b"])
    info = encode_world_info(RESOURCES)
    return cls(args, info) if cls is mr.PDSHRunner else cls(args, info, POOL)


def test_signatures_are_deepspeeds() -> None:
    assert list(inspect.signature(mr.PDSHRunner).parameters) == ["args", "world_info_base64"]
    for cls in (mr.OpenMPIRunner, mr.MPICHRunner, mr.IMPIRunner, mr.SlurmRunner):
        assert list(inspect.signature(cls).parameters) == [
            "args",
            "world_info_base64",
            "resource_pool",
        ]
    params = inspect.signature(mr.MultiNodeRunner.get_cmd).parameters
    assert list(params)[1:] == ["environment", "active_resources"]
    names = {
        cls.__name__: _runner(cls).name
        for cls in (mr.PDSHRunner, mr.OpenMPIRunner, mr.MPICHRunner, mr.IMPIRunner)
    }
    assert names == {
        "PDSHRunner": "pdsh",
        "OpenMPIRunner": "openmpi",
        "MPICHRunner": "mpich",
        "IMPIRunner": "impi",
    }
    assert (mr.SlurmRunner.LAUNCHER, mr.MVAPICHRunner.LAUNCHER) == ("slurm", "mvapich")


def test_pdsh_starts_the_node_agent_and_sets_its_variables() -> None:
    runner = _runner(mr.PDSHRunner, "--ssh_port", "2222")
    runner.add_export("MY_FLAG", "two words")
    assert runner.exports == {"MY_FLAG": '"two words"'}  # shell-quoted, as DeepSpeed keeps it
    env = {"PATH": "/usr/bin"}
    cmd = runner.get_cmd(env, RESOURCES)
    assert cmd[1:6] == ["-S", "-f", "1024", "-w", "w1,w2"]
    assert env["PDSH_RCMD_TYPE"] == "ssh" and "-p 2222" in env["PDSH_SSH_ARGS_APPEND"]
    remote = cmd[-1]
    assert "'MY_FLAG=two words'" in remote and "ds_launch.node" in remote
    assert remote.endswith("train.py --lr 'a b'")


def test_openmpi_writes_its_hostfile_and_exports(tmp_path: Path) -> None:
    runner = _runner(mr.OpenMPIRunner)
    assert runner.exports == {"UCX_TLS": "tcp"}  # DeepSpeed's OpenMPI default
    runner.add_export("MY_FLAG", "1")
    cmd = runner.get_cmd({"NCCL_DEBUG": "INFO"}, RESOURCES)
    assert cmd[1:3] == ["-n", "4"]
    hostfile = Path(cmd[cmd.index("--hostfile") + 1])
    assert hostfile.read_text() == "w1 slots=2\nw2 slots=2\n"
    exported = [cmd[i + 1] for i, word in enumerate(cmd) if word == "-x"]
    for pair in ("UCX_TLS=tcp", "MY_FLAG=1", "NCCL_DEBUG=INFO", "MASTER_ADDR=w1"):
        assert pair in exported
    assert cmd[-3:] == ["train.py", "--lr", "a b"]


def test_mpich_impi_and_slurm_place_ranks_per_node() -> None:
    for cls in (mr.MPICHRunner, mr.IMPIRunner, mr.MVAPICHRunner):
        cmd = _runner(cls).get_cmd({}, RESOURCES)
        assert cmd[1:7] == ["-n", "4", "-ppn", "2", "-hosts", "w1,w2"]
    cmd = _runner(mr.SlurmRunner).get_cmd({}, RESOURCES)
    assert cmd[1:5] == ["-n", "4", "--nodes=2", "--ntasks-per-node=2"]


def test_resources_the_launcher_cannot_start_are_value_errors() -> None:
    with pytest.raises(ValueError, match="same number of ranks on every node"):
        mr.SlurmRunner.validate_active_resources({"w1": [0, 1], "w2": [0]})
    mr.PDSHRunner.validate_active_resources({"w1": [0, 1], "w2": [0]})  # the agent can
    with pytest.raises(ValueError, match="world_info_base64 describes"):
        _runner(mr.PDSHRunner).get_cmd({}, {"w1": [0]})
    with pytest.raises(ValueError, match="--save_pid"):  # needs the agent mpirun lacks
        _runner(mr.OpenMPIRunner, "--save_pid").get_cmd({}, RESOURCES)
    with pytest.raises(ValueError, match="--master_port 70000"):  # validate_args, at once
        _runner(mr.PDSHRunner, "--master_port", "70000")
