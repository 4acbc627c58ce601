"""The shared-memory all-gather on 1, 2 and 4 gloo ranks of one host: bit-identical results to the
all-to-all algorithm, segment regrowth, subgroups, async calls, automatic choice, a peer that
never arrives, and no files left in /dev/shm."""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch

from ds_comm import _shm
from ds_testing import run_on_ranks

pytestmark = pytest.mark.skipif(not _shm.SUPPORTED, reason="shm path is x86-64 with /dev/shm only")

WORLD_SIZES = [1, 2, 4]
DTYPES = ["float32", "bfloat16", "float16", "int64", "uint8", "bool", "float8_e4m3fn"]
# Element counts per rank, in call order: odd sizes, growth past the segment, then shrinking.
NUMELS = [1, 7, 1000, 4097, 3, 65_537, 250_001, 12, 1_000_003, 5]


def _leftovers(names: list[str] | None = None) -> list[str]:
    """Files in /dev/shm of this process's segments (other tests may run ds-comm alongside)."""
    if names is None:
        names = [state.name for state in _shm._SHM_GROUPS.values()]
    found = os.listdir(_shm.SHM_DIR)
    return sorted(f for f in found if any(f.startswith(f"{name}-") for name in names))


def _shard(rank: int, numel: int, dtype: str, salt: int) -> torch.Tensor:
    """Random bytes seeded by rank: any bit pattern of the dtype, NaNs included (bools 0/1)."""
    gen = torch.Generator().manual_seed(1009 * salt + rank)
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), generator=gen, dtype=torch.uint8)
    return (raw & 1 if dtype == "bool" else raw).view(getattr(torch, dtype))


def _gathered(numel: int, dtype: str, salt: int, world_size: int) -> torch.Tensor:
    return torch.cat([_shard(r, numel, dtype, salt) for r in range(world_size)])


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _parity_body(rank: int, world_size: int) -> list[str]:
    import ds_comm

    for salt, numel in enumerate(NUMELS):
        for dtype in DTYPES:
            shard = _shard(rank, numel, dtype, salt)
            outs = {}
            for algo in ("shm", "alltoall"):
                out = torch.empty(numel * world_size, dtype=shard.dtype)
                with ds_comm.force_algorithm(all_gather_into_tensor=algo):
                    ds_comm.all_gather_into_tensor(out, shard)
                outs[algo] = out
            assert torch.equal(_bits(outs["shm"]), _bits(outs["alltoall"])), (numel, dtype)
    # a name exists only while the ranks are inside a regrowth, so look once all have left
    torch.distributed.barrier()
    return _leftovers()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_bit_identical_to_alltoall_across_sizes_and_dtypes(world_size: int) -> None:
    assert run_on_ranks(_parity_body, world_size, timeout=300) == [[]] * world_size


def _layouts_body(rank: int, world_size: int) -> int:
    import ds_comm

    checks = 0
    with ds_comm.force_algorithm(all_gather_into_tensor="shm"):
        for salt, numel in enumerate((5, 30_001)):
            shards = [_shard(r, numel, "float32", salt) for r in range(world_size)]
            expected = torch.cat(shards)
            # in place: the input is this rank's slot of the output (FSDP's layout)
            out = torch.zeros(numel * world_size)
            out[rank * numel : (rank + 1) * numel].copy_(shards[rank])
            ds_comm.all_gather_into_tensor(out, out[rank * numel : (rank + 1) * numel])
            assert torch.equal(_bits(out), _bits(expected))
            # strided input and output: staged through contiguous copies
            matrix = torch.zeros(numel * world_size, 2)
            strided_in = torch.stack([shards[rank], shards[rank]], dim=1)[:, 1]
            ds_comm.all_gather_into_tensor(matrix[:, 0], strided_in)
            assert torch.equal(_bits(matrix[:, 0]), _bits(expected))
            assert torch.equal(matrix[:, 1], torch.zeros(numel * world_size))
            checks += 2
    return checks


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_in_place_and_strided(world_size: int) -> None:
    assert run_on_ranks(_layouts_body, world_size, timeout=120) == [4] * world_size


def _async_body(rank: int, world_size: int) -> list[str]:
    import ds_comm

    shards = {n: _shard(rank, n, "float32", n) for n in (100, 70_000, 9, 300_000)}
    outs = {n: torch.empty(n * world_size) for n in shards}
    with ds_comm.force_algorithm(all_gather_into_tensor="shm"):
        works = [
            ds_comm.all_gather_into_tensor(outs[n], s, async_op=True) for n, s in shards.items()
        ]
    for work in reversed(works):  # any wait order: calls finish in issue order
        work.wait()
    for n, out in outs.items():
        assert torch.equal(_bits(out), _bits(_gathered(n, "float32", n, world_size))), n
    torch.distributed.barrier()
    return _leftovers()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_async_calls_back_to_back(world_size: int) -> None:
    assert run_on_ranks(_async_body, world_size, timeout=120) == [[]] * world_size


def _subgroup_body(rank: int, world_size: int) -> list[str]:
    import torch.distributed as dist

    import ds_comm

    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = pairs[rank % 2]
    members = [rank % 2, rank % 2 + 2]
    algos: list[str] = []
    from ds_comm import _instrument

    hook = lambda rec: algos.append(rec.algo)  # noqa: E731
    _instrument.TRACKER.on_end.append(hook)
    try:
        for salt, numel in enumerate((40_000, 3, 90_001)):  # the first and last pick shm
            shard = _shard(rank, numel, "int64", salt)
            out = torch.empty(2 * numel, dtype=torch.int64)
            ds_comm.all_gather_into_tensor(out, shard, group=mine)
            expected = torch.cat([_shard(r, numel, "int64", salt) for r in members])
            assert torch.equal(out, expected), numel
            # a rank outside the group does nothing
            assert ds_comm.all_gather_into_tensor(out, shard, group=pairs[1 - rank % 2]) is None
    finally:
        _instrument.TRACKER.on_end.remove(hook)
    names = [_shm._SHM_GROUPS[group].name for group in pairs if group in _shm._SHM_GROUPS]
    assert len(names) == 1  # only this rank's own pair made a segment
    for group in pairs:
        dist.destroy_process_group(group)
    return algos + _leftovers(names)


def test_subgroups_choose_shm_by_size() -> None:
    for algos in run_on_ranks(_subgroup_body, 4, timeout=120, fresh=True):
        assert algos == ["shm", "alltoall", "shm"]


def _auto_body(rank: int, world_size: int) -> list[str]:
    import ds_comm
    from ds_comm import _collectives, _instrument

    algos: list[str] = []
    hook = lambda rec: algos.append(rec.algo)  # noqa: E731
    _instrument.TRACKER.on_end.append(hook)
    try:
        for numel in (16, _collectives.SHM_MIN_BYTES // 4 // world_size):
            out = torch.empty(numel * world_size)
            ds_comm.all_gather_into_tensor(out, torch.ones(numel))
            assert torch.equal(out, torch.ones_like(out))
        with ds_comm.force_algorithm(all_gather_into_tensor="alltoall"):  # avoiding shm
            ds_comm.all_gather_into_tensor(out, torch.ones(numel))
    finally:
        _instrument.TRACKER.on_end.remove(hook)
    return algos


@pytest.mark.parametrize("world_size", [2, 4])
def test_chosen_automatically_from_the_size_threshold(world_size: int) -> None:
    small = "alltoall" if world_size == 2 else "native"
    for algos in run_on_ranks(_auto_body, world_size, timeout=120):
        assert algos == [small, "shm", "alltoall"]


def _absent_peer_body(rank: int, world_size: int) -> str:
    import torch.distributed as dist

    import ds_comm

    group = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=3))
    out = torch.empty(8 * world_size)
    with ds_comm.force_algorithm(all_gather_into_tensor="shm"):
        ds_comm.all_gather_into_tensor(out, torch.ones(8), group=group)  # segment made together
        if rank == world_size - 1:
            time.sleep(5)  # never arrives at the second call
            return "absent"
        start = time.monotonic()
        try:
            ds_comm.all_gather_into_tensor(out, torch.ones(8), group=group)
        except ds_comm.CollectiveTimeoutError as exc:
            assert time.monotonic() - start < 30
            return str(exc)
    return "no error"


@pytest.mark.parametrize("world_size", [2, 4])
def test_absent_peer_times_out_naming_the_op_and_ranks(world_size: int) -> None:
    results = run_on_ranks(_absent_peer_body, world_size, timeout=120, fresh=True)
    assert results[-1] == "absent"
    for message in results[:-1]:
        assert "all_gather_into_tensor" in message, message
        assert f"waiting for ranks [{world_size - 1}]" in message, message


def test_atexit_hook_unlinks_names_left_by_an_error() -> None:
    path = os.path.join(_shm.SHM_DIR, f"{_shm.PREFIX}test-{os.getpid()}")
    fd, ok = _shm._create(path, 4096)
    assert ok
    os.close(fd)
    assert path in _shm._CREATED and os.path.exists(path)
    _shm._unlink_created()
    assert not os.path.exists(path) and path not in _shm._CREATED


# --- the list all-gather and reduce-scatter ------------------------------------------------------

RS_DTYPES = ["float32", "bfloat16", "float16", "int64", "uint16", "float8_e4m3fn"]
# Elements per destination, in call order: odd sizes, growth past the segment, then shrinking.
RS_NUMELS = [1, 7, 4097, 3, 65_537, 250_001, 12]


def _ints(rank: int, numel: int, dtype: str, salt: int) -> torch.Tensor:
    """Small non-negative integers seeded by rank: sums of 4 are exact in every dtype here."""
    gen = torch.Generator().manual_seed(7919 * salt + rank)
    return torch.randint(0, 4, (numel,), generator=gen).to(torch.float32).to(getattr(torch, dtype))


def _sum(blocks: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([b.to(torch.float64) for b in blocks]).sum(0).to(blocks[0].dtype)


def _list_gather_body(rank: int, world_size: int) -> list[str]:
    import ds_comm

    for salt, numel in enumerate(NUMELS):
        for dtype in ("float32", "bfloat16", "uint8", "float8_e4m3fn"):
            # uneven: rank r contributes numel + r elements
            shards = [_shard(r, numel + r, dtype, salt) for r in range(world_size)]
            outs = {}
            for algo in ("shm", "alltoall"):
                outs[algo] = [torch.empty_like(s) for s in shards]
                with ds_comm.force_algorithm(all_gather=algo):
                    ds_comm.all_gather(outs[algo], shards[rank])
            for r in range(world_size):
                assert torch.equal(_bits(outs["shm"][r]), _bits(shards[r])), (numel, dtype, r)
                assert torch.equal(_bits(outs["alltoall"][r]), _bits(shards[r]))
    # strided outputs (columns of a matrix) and in place (the input is this rank's entry)
    with ds_comm.force_algorithm(all_gather="shm"):
        shards = [_shard(r, 40_000, "float32", 99) for r in range(world_size)]
        matrix = torch.zeros(40_000, world_size)
        ds_comm.all_gather(list(matrix.unbind(1)), shards[rank])
        assert torch.equal(_bits(matrix), _bits(torch.stack(shards, dim=1)))
        outs = [torch.zeros(40_000) for _ in range(world_size)]
        outs[rank].copy_(shards[rank])
        ds_comm.all_gather(outs, outs[rank])
        assert all(torch.equal(_bits(o), _bits(s)) for o, s in zip(outs, shards))
    torch.distributed.barrier()
    return _leftovers()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_list_all_gather_uneven_strided_in_place(world_size: int) -> None:
    assert run_on_ranks(_list_gather_body, world_size, timeout=300) == [[]] * world_size


def _reduce_scatter_body(rank: int, world_size: int) -> list[str]:
    import ds_comm

    n = world_size
    with ds_comm.force_algorithm(
        reduce_scatter_tensor="shm", reduce_scatter="shm", all_gather_into_tensor="shm"
    ):
        for salt, numel in enumerate(RS_NUMELS):
            for dtype in RS_DTYPES:
                inputs = [_ints(r, numel * n, dtype, salt) for r in range(n)]
                expected = _sum([t[rank * numel : (rank + 1) * numel] for t in inputs])
                source = inputs[rank].clone()
                out = torch.empty(numel, dtype=source.dtype)
                ds_comm.reduce_scatter_tensor(out, source)
                assert torch.equal(_bits(out), _bits(expected)), (numel, dtype)
                assert torch.equal(_bits(source), _bits(inputs[rank])), "input changed"
                # in place: the output is this rank's block of the input
                mine = source[rank * numel : (rank + 1) * numel]
                ds_comm.reduce_scatter_tensor(mine, source)
                assert torch.equal(_bits(mine), _bits(expected)), (numel, dtype, "in place")
                # an all-gather in between shares the group's segment and counters
                gathered = torch.empty(numel * n, dtype=out.dtype)
                ds_comm.all_gather_into_tensor(gathered, out)
                assert torch.equal(_bits(gathered), _bits(_sum(inputs))), (numel, dtype)
                # uneven list form: the block for rank j has numel + j elements
                sizes = [numel + j for j in range(n)]
                lists = [
                    list(_ints(r, sum(sizes), dtype, salt + 50).split(sizes)) for r in range(n)
                ]
                out = torch.empty(sizes[rank], dtype=out.dtype)
                ds_comm.reduce_scatter(out, lists[rank])
                assert torch.equal(_bits(out), _bits(_sum([b[rank] for b in lists])))
        # AVG and MAX over a large message, async
        full = [_ints(r, 100_000 * n, "float32", 7) for r in range(n)]
        blocks = [t[rank * 100_000 : (rank + 1) * 100_000] for t in full]
        avg, top = torch.empty(100_000), torch.empty(100_000)
        works = [
            ds_comm.reduce_scatter_tensor(avg, full[rank], op=ds_comm.ReduceOp.AVG, async_op=True),
            ds_comm.reduce_scatter_tensor(top, full[rank], op=ds_comm.ReduceOp.MAX, async_op=True),
        ]
        for work in reversed(works):  # any wait order: calls finish in issue order
            work.wait()
        assert torch.equal(avg, torch.stack(blocks).sum(0) / n)
        assert torch.equal(top, torch.stack(blocks).amax(0))
    torch.distributed.barrier()
    return _leftovers()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter_exact_across_sizes_dtypes_and_layouts(world_size: int) -> None:
    assert run_on_ranks(_reduce_scatter_body, world_size, timeout=300) == [[]] * world_size


def _refused_op_body(rank: int, world_size: int) -> str:
    import ds_comm

    premul = torch.distributed._make_nccl_premul_sum(2.0)
    with ds_comm.force_algorithm(reduce_scatter_tensor="shm"):
        try:
            ds_comm.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * world_size), op=premul)
        except ValueError as exc:
            message = str(exc)
        else:
            message = "no error"
        out = torch.empty(4)  # the group is still in step: the next op completes
        ds_comm.reduce_scatter_tensor(out, torch.ones(4 * world_size))
        assert torch.equal(out, torch.full((4,), float(world_size)))
    return message


def test_unsupported_reduce_op_is_refused_before_any_transfer() -> None:
    for message in run_on_ranks(_refused_op_body, 2, timeout=120):
        assert "not supported" in message, message


def _auto_scatter_body(rank: int, world_size: int) -> list[str]:
    import ds_comm
    from ds_comm import _collectives, _instrument

    algos: list[str] = []
    hook = lambda rec: algos.append(f"{rec.fingerprint.op}:{rec.algo}")  # noqa: E731
    _instrument.TRACKER.on_end.append(hook)
    try:
        for numel in (16, _collectives.SHM_MIN_BYTES // 4 // world_size):
            shard = torch.ones(numel)
            ds_comm.all_gather([torch.empty(numel) for _ in range(world_size)], shard)
            ds_comm.reduce_scatter(shard, [torch.ones(numel) for _ in range(world_size)])
            ds_comm.reduce_scatter_tensor(shard, torch.ones(numel * world_size))
            assert torch.equal(shard, torch.full_like(shard, float(world_size)))
    finally:
        _instrument.TRACKER.on_end.remove(hook)
    return algos


@pytest.mark.parametrize("world_size", [2, 4])
def test_list_all_gather_and_reduce_scatter_choose_shm_from_the_threshold(world_size: int) -> None:
    small = "alltoall" if world_size == 2 else "native"
    expected = [f"all_gather:{small}", "reduce_scatter:alltoall", "reduce_scatter_tensor:alltoall"]
    expected += ["all_gather:shm", "reduce_scatter:shm", "reduce_scatter_tensor:shm"]
    for algos in run_on_ranks(_auto_scatter_body, world_size, timeout=120):
        assert algos == expected
