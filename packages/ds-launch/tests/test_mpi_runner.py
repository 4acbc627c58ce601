"""The mpich runner really launching 2 ranks through MPICH's ``mpirun`` (the ``mpich`` wheel of
the test group) on this machine. The ranks get no ``RANK``/``WORLD_SIZE`` from ds-launch: they
find each other through the variables the MPI launcher sets (``PMI_RANK``, ``PMI_SIZE``) and the
``MASTER_ADDR``/``MASTER_PORT`` ds-launch exports, which ``ds_comm.init_distributed`` reads."""

from __future__ import annotations

import json


def test_mpich_runner_ranks_discover_each_other_through_the_mpi_env(launcher, out_dir, tmp_path):
    port = launcher.free_port()
    result = launcher.run(
        "--launcher=mpich",
        "--force_multi",  # one node: without it the job would run locally
        "--num_gpus=2",
        f"--master_port={port}",
        *launcher.program("allreduce", out_dir),
        cwd=tmp_path,
        env=launcher.env(CUDA_VISIBLE_DEVICES="", NCCL_DSTEST="exported"),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(2):
        res = json.loads((out_dir / f"rank{rank}.json").read_text())
        assert res["launch"] == [rank, 2, rank, "mpich"]
        assert res["sum"] == 1.0
        assert res["env"]["PMI_RANK"] == str(rank)
        assert res["env"]["PMI_SIZE"] == "2"
        assert res["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert res["env"]["MASTER_PORT"] == str(port)
        assert "RANK" not in res["env"] and "WORLD_SIZE" not in res["env"]
        assert res["local_rank_args"] == []  # one mpirun command: no per-rank arguments
        assert res["dstest"] == {"NCCL_DSTEST": "exported"}
