"""Launch-environment discovery as pure functions over a mapping: each launcher, precedence,
explicit overrides, half-set errors and Slurm hostlist expansion."""

from __future__ import annotations

import pytest

from ds_comm._env import LaunchEnv, discover, expand_hostlist, local_rank_from_env, mpi_env_detected
from ds_comm.api import DistributedEnvError

TORCHRUN = {
    "RANK": "3",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "10.1.2.3",
    "MASTER_PORT": "1234",
}
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "5",
    "OMPI_COMM_WORLD_SIZE": "6",
    "OMPI_COMM_WORLD_LOCAL_RANK": "2",
    "MASTER_ADDR": "node0",
}
MPICH = {"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MASTER_ADDR": "node0"}
SLURM = {
    "SLURM_PROCID": "9",
    "SLURM_NTASKS": "16",
    "SLURM_LOCALID": "1",
    "SLURM_NODELIST": "gpu[003-010]",
}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (TORCHRUN, LaunchEnv(3, 8, 1, "10.1.2.3", 1234, "torchrun")),
        (OPENMPI, LaunchEnv(5, 6, 2, "node0", 29500, "openmpi")),
        (MPICH, LaunchEnv(1, 4, 1, "node0", 29500, "mpich")),
        (SLURM, LaunchEnv(9, 16, 1, "gpu003", 29500, "slurm")),
        ({}, LaunchEnv(0, 1, 0, "127.0.0.1", 29500, "single")),
    ],
    ids=["torchrun", "openmpi", "mpich", "slurm", "none"],
)
def test_each_source(env: dict[str, str], expected: LaunchEnv) -> None:
    assert discover(env) == expected


def test_default_port_and_intel_local_rank() -> None:
    env = {"PMI_RANK": "0", "PMI_SIZE": "2", "PMI_LOCAL_RANK": "0", "MASTER_ADDR": "h"}
    assert discover(env, default_port=4000) == LaunchEnv(0, 2, 0, "h", 4000, "mpich")


def test_slurm_step_values_beat_job_values() -> None:
    # Inside an allocation of 16 tasks, `srun -n 4` describes the step that actually runs.
    env = {
        **SLURM,
        "SLURM_PROCID": "2",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_STEP_NODELIST": "b[7-8]",
    }
    got = discover(env)
    assert (got.world_size, got.master_addr) == (4, "b7")


def test_slurm_master_addr_env_wins_over_nodelist() -> None:
    assert discover({**SLURM, "MASTER_ADDR": "login1"}).master_addr == "login1"


@pytest.mark.parametrize(
    ("env", "source"),
    [
        ({**SLURM, **OPENMPI}, "openmpi"),  # mpirun inside sbatch
        ({**SLURM, **MPICH}, "mpich"),
        ({**OPENMPI, **MPICH}, "openmpi"),
        ({**SLURM, **OPENMPI, **TORCHRUN}, "torchrun"),
    ],
)
def test_precedence(env: dict[str, str], source: str) -> None:
    assert discover(env).source == source


def test_mpi_env_detected() -> None:
    assert mpi_env_detected(OPENMPI)
    assert mpi_env_detected(MPICH)
    assert not mpi_env_detected(SLURM)
    assert not mpi_env_detected({})
    # torchrun-style variables are complete: no MPI discovery needed.
    assert not mpi_env_detected({**MPICH, **TORCHRUN})


def test_explicit_args_override_env() -> None:
    got = discover(TORCHRUN, rank=0, world_size=2)
    assert (got.rank, got.world_size, got.master_addr) == (0, 2, "10.1.2.3")


def test_explicit_args_without_env_need_master() -> None:
    with pytest.raises(DistributedEnvError, match="MASTER_ADDR"):
        discover({"LOCAL_RANK": "0"}, rank=1, world_size=2)
    got = discover({"LOCAL_RANK": "0"}, rank=1, world_size=2, require_master=False)
    assert (got.rank, got.world_size, got.source) == (1, 2, "args")


def test_explicit_args_complete_a_half_set_env() -> None:
    assert discover({"RANK": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "h"}, world_size=2).rank == 1


@pytest.mark.parametrize(
    ("env", "missing", "present"),
    [
        ({"RANK": "0"}, "WORLD_SIZE", "RANK"),
        ({"WORLD_SIZE": "2"}, "RANK", "WORLD_SIZE"),
        ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
        ({"PMI_SIZE": "2"}, "PMI_RANK", "PMI_SIZE"),
        ({"SLURM_PROCID": "0"}, "SLURM_STEP_NUM_TASKS or SLURM_NTASKS", "SLURM_PROCID"),
    ],
)
def test_half_set_names_missing(env: dict[str, str], missing: str, present: str) -> None:
    with pytest.raises(DistributedEnvError) as info:
        discover(env)
    message = str(info.value)
    assert f"{present} set but {missing} missing" in message
    assert "init_distributed" in message  # says how to fix it


def test_missing_master_addr_for_multi_rank() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    with pytest.raises(DistributedEnvError, match=r"MASTER_ADDR is missing and world size is 2"):
        discover(env)
    with pytest.raises(DistributedEnvError, match="mpi4py"):
        discover({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0"})
    # A single rank needs no rendezvous address.
    assert discover({"RANK": "0", "WORLD_SIZE": "1"}).master_addr == "127.0.0.1"


def test_missing_local_rank_for_multi_rank() -> None:
    with pytest.raises(DistributedEnvError, match="LOCAL_RANK"):
        discover({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"})


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h"}, "out of range"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE='0' must be >= 1"),
        ({"MASTER_PORT": "70000"}, "not a TCP port"),
        ({**SLURM, "SLURM_NODELIST": "n[1-"}, "SLURM_NODELIST: unbalanced"),
    ],
)
def test_malformed_values(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(DistributedEnvError, match=fragment.replace("[", r"\[")):
        discover(env)


def test_export_writes_torch_env() -> None:
    environ: dict[str, str] = {}
    LaunchEnv(2, 4, 0, "h", 5555, "slurm").export(environ)
    assert environ == {
        "RANK": "2",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "5555",
    }


def test_local_rank_from_env() -> None:
    assert local_rank_from_env({}) == 0
    assert local_rank_from_env({"SLURM_LOCALID": "3"}) == 3
    assert local_rank_from_env({"SLURM_LOCALID": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}) == 1
    assert local_rank_from_env({"LOCAL_RANK": "2", "MPI_LOCALRANKID": "1"}) == 2


@pytest.mark.parametrize(
    ("spec", "hosts"),
    [
        ("localhost", ["localhost"]),
        ("node[01-03,7],gpu-a1", ["node01", "node02", "node03", "node7", "gpu-a1"]),
        ("a,b,c", ["a", "b", "c"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("r[1-2]n[8-9]", ["r1n8", "r1n9", "r2n8", "r2n9"]),
        ("gpu[3]-ib", ["gpu3-ib"]),
        ("x[1,3-4]y,z[5]", ["x1y", "x3y", "x4y", "z5"]),
        (" c[1-2] ", ["c1", "c2"]),
    ],
)
def test_expand_hostlist(spec: str, hosts: list[str]) -> None:
    assert expand_hostlist(spec) == hosts


@pytest.mark.parametrize(
    "spec", ["", "n[1-", "n1-2]", "n[[1]]", "n[a-b]", "n[3-1]", "n[1-]", "a,,b", "n[]"]
)
def test_expand_hostlist_rejects_malformed(spec: str) -> None:
    with pytest.raises(ValueError):
        expand_hostlist(spec)
