"""``deepspeed.comm``'s remaining public names: coalesced ops, ZeRO's tensor forms, group queries,
capability probes, launcher helpers and the comms-log helpers, on 1, 2 and 4 gloo ranks.
"""

from __future__ import annotations

import pytest
import torch

from ds_testing import run_on_ranks

WORLD_SIZES = [1, 2, 4]

# deepspeed.comm 0.19's user-facing names (dir() minus its imports, constants of its config
# module, private helpers and its backend objects).
DEEPSPEED_COMM_NAMES = [
    "P2POp",
    "ProcessGroup",
    "ReduceOp",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "allgather_fn",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "configure",
    "destroy_process_group",
    "enable_symm_mem_for_group",
    "gather",
    "get_all_ranks_from_group",
    "get_comm_operation_count",
    "get_global_rank",
    "get_local_rank",
    "get_local_rank_from_launcher",
    "get_logged_comm_ops",
    "get_rank",
    "get_world_group",
    "get_world_rank_from_launcher",
    "get_world_size",
    "get_world_size_from_launcher",
    "has_all_gather_into_tensor",
    "has_all_reduce_coalesced",
    "has_coalescing_manager",
    "has_comm_data",
    "has_reduce_scatter_tensor",
    "in_aml",
    "in_aws_sm",
    "in_dlts",
    "inference_all_reduce",
    "init_deepspeed_backend",
    "init_distributed",
    "initialize_mesh_device",
    "irecv",
    "is_available",
    "is_initialized",
    "isend",
    "log_summary",
    "monitored_barrier",
    "mpi_discovery",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_fn",
    "reduce_scatter_tensor",
    "reset_log",
    "scatter",
    "send",
    "NCCL_BACKEND",
    "GLOO_BACKEND",
    "MPI_BACKEND",
    "CCL_BACKEND",
    "HCCL_BACKEND",
    "TORCH_DISTRIBUTED_DEFAULT_PORT",
    "default_pg_timeout",
]


def test_every_user_facing_deepspeed_comm_name_exists() -> None:
    import ds_comm

    missing = [name for name in DEEPSPEED_COMM_NAMES if not hasattr(ds_comm, name)]
    assert missing == []
    assert set(DEEPSPEED_COMM_NAMES) <= set(ds_comm.__all__)


def _coalesced_body(rank: int, world_size: int) -> int:
    import ds_comm

    n = world_size
    checks = 0
    for async_op in (False, True):
        # mixed dtypes and shapes, one non-contiguous: one all_reduce per dtype, results in place
        a = torch.full((2, 3), float(rank + 1))
        b = torch.arange(4, dtype=torch.int64) * (rank + 1)
        c = torch.full((3, 2), float(rank)).t()  # strided view
        d = torch.ones(5, dtype=torch.bfloat16) * (rank + 1)
        handle = ds_comm.all_reduce_coalesced([a, b, c, d], async_op=async_op)
        if async_op:
            handle.wait()
        total = n * (n + 1) // 2
        assert torch.equal(a, torch.full((2, 3), float(total)))
        assert torch.equal(b, torch.arange(4) * total)
        assert torch.equal(c, torch.full((2, 3), float(n * (n - 1) // 2)))
        assert torch.equal(d, torch.full((5,), float(total), dtype=torch.bfloat16))
        checks += 1

        ins = [torch.full((3,), float(rank)), torch.tensor([rank, -rank]), torch.full((2,), 7.0)]
        outs = [torch.empty(3 * n), torch.empty(2 * n, dtype=torch.int64), torch.empty(n, 2)]
        handle = ds_comm.all_gather_coalesced(outs, ins, async_op=async_op)
        if async_op:
            handle.wait()
        assert torch.equal(outs[0], torch.arange(n).repeat_interleave(3).float())
        assert outs[1].tolist() == [v for r in range(n) for v in (r, -r)]
        assert torch.equal(outs[2], torch.full((n, 2), 7.0))
        checks += 1

    t = torch.full((3,), float(rank))
    assert ds_comm.inference_all_reduce(t) is None
    assert torch.equal(t, torch.full((3,), float(n * (n - 1) // 2)))
    return checks + 1


def _tensor_forms_body(rank: int, world_size: int) -> list[str]:
    import ds_comm
    from ds_comm import _instrument

    n = world_size
    sites: list[str] = []
    hook = lambda rec: sites.append(f"{rec.fingerprint.op}@{rec.fingerprint.site}")  # noqa: E731
    _instrument.TRACKER.on_end.append(hook)
    try:
        out = torch.empty(2 * n)
        ds_comm.allgather_fn(out, torch.full((2,), float(rank)), debug="zero.fetch")
        assert torch.equal(out, torch.arange(n).repeat_interleave(2).float())
        shard = torch.empty(2)
        work = ds_comm.reduce_scatter_fn(shard, torch.ones(2 * n), async_op=True)
        work.wait()
        assert torch.equal(shard, torch.full((2,), float(n)))
    finally:
        _instrument.TRACKER.on_end.remove(hook)
    try:
        ds_comm.reduce_scatter_fn(shard, torch.ones(2 * n), prof=True)
    except NotImplementedError as exc:
        sites.append(str(exc))
    return sites


def _queries_body(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    import ds_comm

    sub = ds_comm.new_group(list(range(world_size - 1, -1, -2)))  # e.g. [3, 1] on 4 ranks
    return {
        "available": ds_comm.is_available(),
        "backend": ds_comm.get_backend(),
        "world": ds_comm.get_world_group() is dist.group.WORLD,
        "all_ranks": ds_comm.get_all_ranks_from_group(),
        "sub_ranks": ds_comm.get_all_ranks_from_group(sub)
        if rank % 2 == (world_size - 1) % 2
        else None,
        "global_of_sub_0": ds_comm.get_global_rank(sub, 0)
        if rank % 2 == (world_size - 1) % 2
        else None,
        "probes": [
            ds_comm.has_all_gather_into_tensor(),
            ds_comm.has_reduce_scatter_tensor(),
            ds_comm.has_all_reduce_coalesced(),
            ds_comm.has_coalescing_manager(),
        ],
        "launcher": [
            ds_comm.get_world_rank_from_launcher(),
            ds_comm.get_world_size_from_launcher(),
            ds_comm.get_local_rank_from_launcher(),
        ],
    }


def _log_helpers_body(rank: int, world_size: int) -> list:
    import ds_comm

    previous = ds_comm.configure(enabled=True)
    try:
        ds_comm.reset_log()
        empty = [ds_comm.has_comm_data(), ds_comm.get_comm_operation_count()]
        t = torch.ones(8)
        for _ in range(3):
            ds_comm.all_reduce(t)
        ds_comm.broadcast(t, 0)
        logged = [
            ds_comm.has_comm_data(),
            ds_comm.get_comm_operation_count(),
            ds_comm.get_logged_comm_ops(),
        ]
        summary = ds_comm.log_summary(show_straggler=True, return_dict=True)
        row = summary["summary"]["all_reduce"][32]
        straggler = summary["straggler_analysis"]["all_reduce"][32]
        ds_comm.reset_log()
        return [
            empty,
            logged,
            row["count"],
            row["msg_size_bytes"],
            row["avg_latency_ms"] > 0,
            straggler["count"],
            straggler["avg_straggler_ms"] >= 0,
            summary["metadata"]["world_size"],
            summary["metadata"]["rank"],
            ds_comm.has_comm_data(),
        ]
    finally:
        ds_comm.configure(previous)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_coalesced_ops(world_size: int) -> None:
    assert run_on_ranks(_coalesced_body, world_size) == [5] * world_size


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_zero_tensor_forms_are_tracked_with_the_callers_site(world_size: int) -> None:
    for sites in run_on_ranks(_tensor_forms_body, world_size):
        assert sites[0] == "all_gather_into_tensor@zero.fetch"
        assert sites[1].startswith("reduce_scatter_tensor@test_deepspeed_names.py:")
        assert "prof=True): per-call profiling is not implemented" in sites[2]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_group_queries_and_probes(world_size: int) -> None:
    results = run_on_ranks(_queries_body, world_size)
    sub = list(range(world_size - 1, -1, -2))
    for rank, res in enumerate(results):
        assert res["available"] and res["backend"] == "gloo" and res["world"]
        assert res["all_ranks"] == list(range(world_size))
        if rank in sub:
            # torch orders a group's ranks ascending whatever order new_group was given
            assert res["sub_ranks"] == sorted(sub) and res["global_of_sub_0"] == min(sub)
        assert res["probes"] == [True, True, True, False]
        assert res["launcher"] == [rank, world_size, rank]


@pytest.mark.parametrize("world_size", [1, 2])
def test_comm_log_helpers(world_size: int) -> None:
    for rank, res in enumerate(run_on_ranks(_log_helpers_body, world_size)):
        assert res[0] == [False, 0]
        assert res[1] == [True, 4, ["all_reduce", "broadcast"]]
        assert res[2:] == [3, 32, True, 3, True, world_size, rank, False]


def test_launcher_helpers_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import ds_comm

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert ds_comm.get_world_rank_from_launcher() == 0
    assert ds_comm.get_world_size_from_launcher() == 1
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "5")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "8")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    assert ds_comm.get_world_rank_from_launcher() == 5
    assert ds_comm.get_world_size_from_launcher() == 8
    assert ds_comm.get_local_rank_from_launcher() == 1
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ValueError, match="LOCAL_RANK='x' is not an integer"):
        ds_comm.get_local_rank_from_launcher()
    monkeypatch.setenv("AZUREML_EXPERIMENT_ID", "1")
    assert ds_comm.in_aml() and not ds_comm.in_dlts()


def test_refusals_name_the_feature() -> None:
    import ds_comm

    with pytest.raises(NotImplementedError, match="symmetric memory is not implemented in ds"):
        ds_comm.enable_symm_mem_for_group("g")
    with pytest.raises(NotImplementedError, match="the ccl backend is not implemented in ds"):
        ds_comm.init_deepspeed_backend("ccl", ds_comm.default_pg_timeout, None)
    with pytest.raises(ds_comm.DistributedEnvError, match="get_global_rank: no default process"):
        ds_comm.get_global_rank()
