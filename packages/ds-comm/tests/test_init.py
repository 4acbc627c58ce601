"""init_distributed on real processes: from torchrun-style and Slurm env, explicit arguments,
idempotence, adopting an existing group, and half-set environments."""

from __future__ import annotations

import pytest

from ds_testing import run_on_ranks

_TORCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")


def _sum_of_ranks() -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _init_from_env(rank: int, world_size: int, *, explicit: bool) -> dict:
    import contextlib
    import io
    import os
    from datetime import timedelta

    import torch.distributed as dist

    import ds_comm

    assert not ds_comm.is_initialized()
    if explicit:
        del os.environ["RANK"], os.environ["WORLD_SIZE"]
    kwargs = {"rank": rank, "world_size": world_size} if explicit else {}
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        launch = ds_comm.init_distributed(timeout=timedelta(seconds=60), **kwargs)
    assert ds_comm.is_initialized()
    world = dist.group.WORLD
    again = ds_comm.init_distributed()  # a no-op that adopts the group just made
    assert dist.group.WORLD is world
    result = {
        "launch": (launch.rank, launch.world_size, launch.local_rank, launch.source),
        "again": again.source,
        "queries": (ds_comm.get_rank(), ds_comm.get_world_size(), ds_comm.get_local_rank()),
        "exported": (os.environ["RANK"], os.environ["WORLD_SIZE"]),
        "sum": _sum_of_ranks(),
        "stderr": err.getvalue(),
    }
    ds_comm.destroy_process_group()
    assert not ds_comm.is_initialized()
    return result


@pytest.mark.parametrize(
    ("world_size", "explicit"),
    [(1, False), (2, False), (2, True)],
    ids=["1-env", "2-env", "2-args"],
)
def test_init_from_env(world_size: int, explicit: bool) -> None:
    results = run_on_ranks(
        _init_from_env, world_size, init_process_group=False, fresh=True, explicit=explicit
    )
    # With explicit=True, RANK/WORLD_SIZE were removed and the arguments supplied them.
    source = "args" if explicit else "torchrun"
    expected_sum = float(sum(range(world_size)))
    for rank, res in enumerate(results):
        assert res["launch"] == (rank, world_size, rank, source)
        assert res["again"] == "existing"
        assert res["queries"] == (rank, world_size, rank)
        assert res["exported"] == (str(rank), str(world_size))
        assert res["sum"] == expected_sum
    line = results[0]["stderr"].strip()
    assert "\n" not in line and "gloo" in line and f"world_size={world_size}" in line, line
    assert all(res["stderr"] == "" for res in results[1:])


def _adopt_existing(rank: int, world_size: int) -> dict:
    import contextlib
    import io

    import ds_comm
    from ds_comm.api import DistributedEnvError

    ds_comm.init_distributed()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        launch = ds_comm.init_distributed()
    try:
        ds_comm.init_distributed(world_size=world_size + 1)
    except DistributedEnvError as exc:
        mismatch = str(exc)
    else:
        mismatch = ""
    return {
        "launch": (launch.rank, launch.world_size, launch.source),
        "second_call_output": err.getvalue(),
        "mismatch": mismatch,
        "sum": _sum_of_ranks(),
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_adopts_harness_group(world_size: int) -> None:
    results = run_on_ranks(_adopt_existing, world_size)
    for rank, res in enumerate(results):
        assert res["launch"] == (rank, world_size, "existing")
        assert res["second_call_output"] == ""  # announced at most once per process
        assert f"already initialised as rank {rank} of {world_size}" in res["mismatch"]
        assert res["sum"] == float(sum(range(world_size)))


def _init_from_slurm(rank: int, world_size: int) -> dict:
    import os

    import ds_comm

    for name in _TORCH_VARS:
        os.environ.pop(name, None)
    os.environ.update(
        SLURM_PROCID=str(rank),
        SLURM_NTASKS=str(world_size),
        SLURM_LOCALID=str(rank),
        SLURM_NODELIST="localhost",
    )
    launch = ds_comm.init_distributed(verbose=False)
    result = {
        "launch": (launch.rank, launch.world_size, launch.local_rank, launch.master_addr),
        "source": launch.source,
        "exported": {name: os.environ.get(name) for name in ("RANK", "MASTER_ADDR")},
        "sum": _sum_of_ranks(),
    }
    ds_comm.destroy_process_group()
    return result


def test_init_from_slurm_env() -> None:
    results = run_on_ranks(_init_from_slurm, 2, init_process_group=False, fresh=True)
    for rank, res in enumerate(results):
        assert res["source"] == "slurm"
        assert res["launch"] == (rank, 2, rank, "localhost")
        assert res["exported"] == {"RANK": str(rank), "MASTER_ADDR": "localhost"}
        assert res["sum"] == 1.0


def _alone(rank: int, world_size: int) -> list:
    """``init_distributed`` with no launcher and no ``MASTER_PORT``, first with its port taken
    by another listener, then with it free."""
    import os
    import socket

    import ds_comm

    def launched(port: int) -> list:
        for name in (*_TORCH_VARS, "MASTER_PORT"):
            os.environ.pop(name, None)
        launch = ds_comm.init_distributed(distributed_port=port, verbose=False)
        try:
            exported = os.environ["MASTER_PORT"] == str(launch.master_port)
            return [launch.source, launch.master_port == port, exported, _sum_of_ranks()]
        finally:
            ds_comm.destroy_process_group()

    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        busy = launched(taken.getsockname()[1])
    with socket.socket() as probe:
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    return [busy, launched(port)]


def test_a_process_alone_takes_a_free_port_when_its_port_is_taken() -> None:
    """A lone process (no launcher, no MASTER_PORT) whose port another job holds (a second
    notebook, a second test run on the host) starts on a free port, not EADDRINUSE; a free
    port is kept."""
    ((busy, free),) = run_on_ranks(_alone, 1, init_process_group=False, fresh=True)
    assert busy == ["single", False, True, 0.0], busy
    assert free == ["single", True, True, 0.0], free


def _half_set(rank: int, world_size: int) -> str:
    import os

    import ds_comm
    from ds_comm.api import DistributedEnvError

    del os.environ["WORLD_SIZE"]
    try:
        ds_comm.init_distributed(verbose=False)
    except DistributedEnvError as exc:
        assert not ds_comm.is_initialized()
        return str(exc)
    raise AssertionError("init_distributed accepted RANK without WORLD_SIZE")


def test_half_set_env_is_a_clear_error() -> None:
    (message,) = run_on_ranks(_half_set, 1, init_process_group=False, fresh=True)
    assert "RANK set but WORLD_SIZE missing" in message


def _deepspeed_keywords(rank: int, world_size: int) -> list:
    import ds_comm
    from ds_comm.api import DistributedEnvError

    out = []
    try:  # dist_init_required=False: a group must exist already
        ds_comm.init_distributed(dist_init_required=False, verbose=False)
    except DistributedEnvError as exc:
        out.append(str(exc))
    previous = ds_comm.configure()
    try:
        config = {"train_batch_size": 8, "comms_logger": {"enabled": True, "prof_all": False}}
        launch = ds_comm.init_distributed(config=config, dist_init_required=True, verbose=False)
        logger_config = ds_comm.get_comms_logger().config
        out.append([launch.world_size, logger_config.enabled, logger_config.prof_all])
        # a config without the section leaves DeepSpeed's defaults; the group is adopted
        ds_comm.init_distributed(config={"train_batch_size": 8}, dist_init_required=False)
        out.append(ds_comm.get_comms_logger().config.enabled)
        ds_comm.configure(deepspeed_config={"comms_logger": {"verbose": True}})
        out.append(ds_comm.get_comms_logger().config.verbose)
    finally:
        ds_comm.configure(previous)
        ds_comm.destroy_process_group()
    return out


def test_deepspeed_keywords() -> None:
    (out,) = run_on_ranks(_deepspeed_keywords, 1, init_process_group=False, fresh=True)
    assert "dist_init_required=False) but no default process group exists" in out[0]
    assert out[1:] == [[1, True, False], False, True]
