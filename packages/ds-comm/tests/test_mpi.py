"""init_distributed under a real ``mpiexec -n 2``: rank 0's address and port through mpi4py, and
the plain environment path with mpi4py discovery switched off.

The ranks run this same file as a script (see ``_rank_main``), so the code they execute is
linted and read alongside the assertions about it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

_TIMEOUT_S = 120
# Launcher variables of the pytest process must not leak into the MPI ranks: the point is that
# they find everything from mpiexec (and mpi4py) alone.
_STRIP_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "SLURM_", "MPI_LOCAL", "HYDRA_")
_STRIP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _find_mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _run_under_mpiexec(mode: str, port: int, extra_env: dict[str, str]) -> list[dict]:
    mpiexec = _find_mpiexec()
    if mpiexec is None:
        # The test group installs the mpich wheel: a missing launcher is a broken setup, not a skip.
        pytest.fail("no mpiexec next to the interpreter or on PATH (install ds-comm's test group)")
    env = {
        k: v for k, v in os.environ.items() if k not in _STRIP and not k.startswith(_STRIP_PREFIXES)
    }
    env.update(extra_env)
    # Each rank writes its own result file: mpiexec merges the ranks' stdout, and two lines
    # printed at once can interleave.
    result_dir = tempfile.mkdtemp(prefix="ds-comm-mpi-")
    env["DS_TEST_RESULT_DIR"] = result_dir
    cmd = [mpiexec, "-n", "2", sys.executable, __file__, mode, str(port)]
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} timed out after {_TIMEOUT_S} s; output:\n{output}")
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}; output:\n{output}")
    files = sorted(Path(result_dir).glob("rank*.json"))
    results = [json.loads(f.read_text()) for f in files]
    shutil.rmtree(result_dir, ignore_errors=True)
    assert len(results) == 2, output
    return sorted(results, key=lambda r: r["rank"])


def test_mpi4py_discovery() -> None:
    # Rank 0 holds `busy` open, so it must pick another port; rank 1 can only learn which one
    # from rank 0's broadcast (its own free-port search would land elsewhere).
    busy = _free_port()
    results = _run_under_mpiexec("mpi4py", busy, {})
    for rank, res in enumerate(results):
        assert res["launcher_rank"] == rank and res["launcher_size"] == 2
        assert res["launch"] == [rank, 2, "mpi4py"]
        assert res["sum"] == 1.0
    master = results[0]["master"]
    assert all(res["master"] == master for res in results), results
    assert master[0] == results[0]["own_address"]  # rank 0's address reached rank 1
    assert master[1] != busy
    assert all(res["env_port"] == str(master[1]) for res in results)


@pytest.mark.slow  # the mpi4py path runs by default; each mpiexec run starts 2 torch processes
def test_explicit_mpi_discovery() -> None:
    busy = _free_port()
    results = _run_under_mpiexec("discovery", busy, {})
    for rank, res in enumerate(results):
        assert res["launcher_rank"] == rank and res["launch"][:2] == [rank, 2]
        assert res["sum"] == 1.0
    master = results[0]["master"]
    assert all(res["master"] == master for res in results) and master[1] != busy


@pytest.mark.slow
def test_env_path_without_mpi4py() -> None:
    port = _free_port()
    results = _run_under_mpiexec(
        "env", port, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    )
    for rank, res in enumerate(results):
        assert res["launch"] == [rank, 2, results[0]["launch"][2]]
        assert res["launch"][2] in ("mpich", "openmpi")
        assert res["master"] == ["127.0.0.1", port]
        assert res["mpi4py_imported"] is False
        assert res["sum"] == 1.0


def _rank_main(mode: str, port: int) -> None:
    """One MPI rank: init from nothing but the launcher's environment, then all_reduce."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import ds_comm
    from ds_comm._mpi import host_address

    launcher_rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", -1)))
    launcher_size = int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", -1)))
    assert "MASTER_ADDR" not in os.environ or mode == "env"
    holder = socket.socket()
    if mode in ("mpi4py", "discovery") and launcher_rank == 0:
        holder.bind(("", port))
        holder.listen()
    if mode == "discovery":  # DeepSpeed's explicit step, then a plain env:// initialisation
        discovered = ds_comm.mpi_discovery(distributed_port=port, verbose=False)
        assert os.environ["RANK"] == str(discovered.rank) == str(launcher_rank)
        assert os.environ["MASTER_PORT"] == str(discovered.master_port)
    # A short timeout turns a wrong master address into a rendezvous error, not a kill.
    launch = ds_comm.init_distributed(
        auto_mpi_discovery=(mode == "mpi4py"),
        distributed_port=port,
        verbose=False,
        timeout=timedelta(seconds=60),
    )
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    result = {
        "rank": dist.get_rank(),
        "launcher_rank": launcher_rank,
        "launcher_size": launcher_size,
        "launch": [launch.rank, launch.world_size, launch.source],
        "master": [launch.master_addr, launch.master_port],
        "env_port": os.environ["MASTER_PORT"],
        "own_address": host_address(),
        "mpi4py_imported": "mpi4py.MPI" in sys.modules,
        "sum": t.item(),
    }
    ds_comm.destroy_process_group()
    holder.close()
    out = Path(os.environ["DS_TEST_RESULT_DIR"]) / f"rank{launcher_rank}.json"
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]))
