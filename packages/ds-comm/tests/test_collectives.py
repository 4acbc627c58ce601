"""Every public collective on 1, 2 and 4 gloo ranks, per dtype, algorithm, sync/async and subgroup.

Each body computes every rank's input in-rank (integer-valued data seeded by rank, so that every
algorithm, dtype and summation order gives the exact same result) and compares with a
single-process reference. Algorithms are pinned with ``force_algorithm``, so the fallbacks that
torch 2.15's gloo never needs (upcast, bytes, direct p2p, ring, allreduce-slice) are checked
against the same reference as the native ops and ds-comm's faster all-to-all paths.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from ds_testing import run_on_ranks

WORLD_SIZES = [1, 2, 4]
DTYPES = ["float32", "float16", "bfloat16", "int64"]
FLOAT_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "AVG"]
INT_OPS = ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"]


def _values(rank: int, numel: int, dtype: str, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: small integers, exact in bf16 even after sums and products of 4."""
    gen = torch.Generator().manual_seed(7919 * salt + rank)
    low = 0 if dtype in ("uint8", "uint16") else -3
    return torch.randint(low, 4, (numel,), generator=gen).to(getattr(torch, dtype))


def _reference(tensors: list[torch.Tensor], op: str) -> torch.Tensor:
    """Single-process reduction in int64/float64, cast back to the inputs' dtype."""
    dtype = tensors[0].dtype
    wide = [t.to(torch.float64 if dtype.is_floating_point else torch.int64) for t in tensors]
    stacked = torch.stack(wide)
    if op == "SUM":
        out = stacked.sum(0)
    elif op == "AVG":
        out = stacked.sum(0) / len(tensors)
    elif op == "PRODUCT":
        out = stacked.prod(0)
    elif op == "MIN":
        out = stacked.amin(0)
    elif op == "MAX":
        out = stacked.amax(0)
    else:
        fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
        out = functools.reduce(fn, wide)
    return out.to(dtype)


def _ops(dtype: str) -> list[str]:
    return FLOAT_OPS if getattr(torch, dtype).is_floating_point else INT_OPS


def _same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert torch.equal(actual, expected), f"{what}:\n got      {actual}\n expected {expected}"


def _finish(handle: object, async_op: bool, what: str) -> None:
    if async_op:
        assert handle is not None and hasattr(handle, "wait"), f"{what}: no handle"
        handle.wait()
    else:
        assert handle is None, f"{what}: sync call returned {handle!r}"


# --- bodies (run in every rank) ------------------------------------------------------------------


def _reductions_body(rank: int, world_size: int) -> int:
    import ds_comm
    from ds_comm._collectives import force_algorithm

    checks = 0
    for salt, (dtype, async_op) in enumerate(itertools.product(DTYPES, (False, True))):
        for op_name in _ops(dtype):
            op = getattr(ds_comm.ReduceOp, op_name)
            everyone = [_values(r, 13, dtype, salt) for r in range(world_size)]
            expected = _reference(everyone, op_name)
            for algo in ("native", "upcast"):
                what = f"{dtype} {op_name} {algo} async={async_op}"
                with force_algorithm(all_reduce=algo, reduce=algo):
                    t = everyone[rank].clone()
                    _finish(ds_comm.all_reduce(t, op=op, async_op=async_op), async_op, what)
                    _same(t, expected, f"all_reduce {what}")
                    dst = world_size - 1
                    t = everyone[rank].clone()
                    _finish(ds_comm.reduce(t, dst, op=op, async_op=async_op), async_op, what)
                    if rank == dst:
                        _same(t, expected, f"reduce {what}")
                checks += 2
        for algo in ("native", "bytes"):
            with force_algorithm(broadcast=algo):
                src = 0 if salt % 2 else world_size - 1
                t = _values(rank, 9, dtype, salt)
                _finish(ds_comm.broadcast(t, src, async_op=async_op), async_op, "broadcast")
                _same(t, _values(src, 9, dtype, salt), f"broadcast {dtype} {algo} from {src}")
                checks += 1
    return checks


def _all_gather_body(rank: int, world_size: int) -> int:
    import ds_comm
    from ds_comm._collectives import force_algorithm

    checks = 0
    for salt, (dtype, async_op, algo) in enumerate(
        itertools.product(DTYPES, (False, True), ("native", "shm", "alltoall", "direct", "ring"))
    ):
        what = f"{dtype} {algo} async={async_op}"
        with force_algorithm(all_gather=algo, all_gather_into_tensor=algo):
            # odd element count, 2-D input: the output is concatenated along dim 0
            shards = [_values(r, 7, dtype, salt).view(7, 1) for r in range(world_size)]
            out = torch.full((7 * world_size, 1), 99, dtype=getattr(torch, dtype))
            handle = ds_comm.all_gather_into_tensor(out, shards[rank], async_op=async_op)
            _finish(handle, async_op, what)
            _same(out, torch.cat(shards), f"all_gather_into_tensor {what}")
            # in place: the input is this rank's slot of the output (FSDP's layout)
            out = torch.full((7 * world_size,), 99, dtype=getattr(torch, dtype))
            mine = out[7 * rank : 7 * rank + 7]
            mine.copy_(shards[rank].view(-1))
            handle = ds_comm.all_gather_into_tensor(out, mine, async_op=async_op)
            _finish(handle, async_op, what)
            _same(out, torch.cat(shards).view(-1), f"in-place all_gather_into_tensor {what}")
            # the list form
            outs = [torch.zeros(7, 1, dtype=out.dtype) for _ in range(world_size)]
            _finish(ds_comm.all_gather(outs, shards[rank], async_op=async_op), async_op, what)
            for r in range(world_size):
                _same(outs[r], shards[r], f"all_gather {what} from rank {r}")
            # uneven sizes (rank r contributes 2r+1 elements): gloo's native all_gather refuses
            # these, so the unforced call must pick a working algorithm by itself
            if algo != "native":
                uneven = [_values(r, 2 * r + 1, dtype, salt) for r in range(world_size)]
                outs = [torch.zeros(2 * r + 1, dtype=out.dtype) for r in range(world_size)]
                _finish(ds_comm.all_gather(outs, uneven[rank], async_op=async_op), async_op, what)
                for r in range(world_size):
                    _same(outs[r], uneven[r], f"uneven all_gather {what} from rank {r}")
                checks += 1
        checks += 2
    # strided destinations in the list form (columns of a matrix) are filled in place
    shard = _values(rank, 5, "float32", 1)
    matrix = torch.zeros(5, world_size)
    ds_comm.all_gather(list(matrix.unbind(1)), shard)
    expected = torch.stack([_values(r, 5, "float32", 1) for r in range(world_size)], dim=1)
    _same(matrix, expected, "all_gather into strided outputs")
    return checks + 1


def _reduce_scatter_body(rank: int, world_size: int) -> int:
    import ds_comm
    from ds_comm._collectives import force_algorithm

    checks = 0
    algos = ("native", "shm", "alltoall", "direct", "ring", "allreduce-slice")
    for salt, (dtype, async_op) in enumerate(itertools.product(DTYPES, (False, True))):
        for op_name in _ops(dtype):
            op = getattr(ds_comm.ReduceOp, op_name)
            # 5 elements per rank (odd), 2-D input of world_size*5 rows
            full = [_values(r, 5 * world_size, dtype, salt).view(-1, 1) for r in range(world_size)]
            expected = _reference(full, op_name)[5 * rank : 5 * (rank + 1)]
            # uneven list form: rank r's block has r+2 elements
            sizes = [r + 2 for r in range(world_size)]
            lists = [
                list(_values(r, sum(sizes), dtype, salt + 100).split(sizes))
                for r in range(world_size)
            ]
            expected_mine = _reference([blocks[rank] for blocks in lists], op_name)
            for algo in algos:
                what = f"{dtype} {op_name} {algo} async={async_op}"
                with force_algorithm(reduce_scatter=algo, reduce_scatter_tensor=algo):
                    out = torch.full((5, 1), 99, dtype=getattr(torch, dtype))
                    source = full[rank].clone()
                    handle = ds_comm.reduce_scatter_tensor(out, source, op=op, async_op=async_op)
                    _finish(handle, async_op, what)
                    _same(out, expected, f"reduce_scatter_tensor {what}")
                    _same(source, full[rank], f"reduce_scatter_tensor {what} changed its input")
                    # in place: the output is this rank's block of the input
                    source = full[rank].clone().view(-1)
                    mine = source[5 * rank : 5 * rank + 5]
                    handle = ds_comm.reduce_scatter_tensor(mine, source, op=op, async_op=async_op)
                    _finish(handle, async_op, what)
                    _same(mine, expected.view(-1), f"in-place reduce_scatter_tensor {what}")
                    if algo != "native":  # gloo's own refuses uneven blocks
                        out = torch.full((sizes[rank],), 99, dtype=getattr(torch, dtype))
                        handle = ds_comm.reduce_scatter(out, lists[rank], op=op, async_op=async_op)
                        _finish(handle, async_op, what)
                        _same(out, expected_mine, f"uneven reduce_scatter {what}")
                    checks += 2
    # even list form with the default (unforced) algorithm
    blocks = [list(_values(r, 3 * world_size, "float32", 5).split(3)) for r in range(world_size)]
    out = torch.empty(3)
    ds_comm.reduce_scatter(out, blocks[rank])
    _same(out, _reference([b[rank] for b in blocks], "SUM"), "reduce_scatter (default algorithm)")
    return checks + 1


def _all_to_all_body(rank: int, world_size: int) -> int:
    import ds_comm
    from ds_comm._collectives import force_algorithm

    checks = 0
    for salt, (dtype, async_op, algo) in enumerate(
        itertools.product(DTYPES, (False, True), ("native", "direct"))
    ):
        what = f"{dtype} {algo} async={async_op}"
        with force_algorithm(all_to_all_single=algo):
            # even: rank r sends rows [3p, 3p+3) of its input (3 rows x 2 cols each) to rank p
            inputs = [
                _values(r, 6 * world_size, dtype, salt).view(-1, 2) for r in range(world_size)
            ]
            out = torch.full((3 * world_size, 2), 99, dtype=getattr(torch, dtype))
            _finish(ds_comm.all_to_all_single(out, inputs[rank], async_op=async_op), async_op, what)
            expected = torch.cat([inputs[r][3 * rank : 3 * rank + 3] for r in range(world_size)])
            _same(out, expected, f"all_to_all_single {what}")
            # uneven: rank r sends r+p+1 rows to rank p (an odd total for some ranks)
            splits = [[r + p + 1 for p in range(world_size)] for r in range(world_size)]
            inputs = [_values(r, sum(splits[r]), dtype, salt + 50) for r in range(world_size)]
            recv_splits = [splits[r][rank] for r in range(world_size)]
            out = torch.full((sum(recv_splits),), 99, dtype=getattr(torch, dtype))
            handle = ds_comm.all_to_all_single(
                out, inputs[rank], recv_splits, splits[rank], async_op=async_op
            )
            _finish(handle, async_op, what)
            expected = torch.cat([inputs[r].split(splits[r])[rank] for r in range(world_size)])
            _same(out, expected, f"uneven all_to_all_single {what}")
            checks += 2
    return checks


def _p2p_body(rank: int, world_size: int) -> int:
    import ds_comm

    nxt, prv = (rank + 1) % world_size, (rank - 1) % world_size
    checks = 0
    # int16 is a dtype gloo has no type for: p2p moves bytes, so it still travels
    for salt, dtype in enumerate([*DTYPES, "int16"]):
        mine = _values(rank, 11, dtype, salt)
        from_prev = _values(prv, 11, dtype, salt)
        if world_size == 1:
            continue
        # blocking, ordered so the ring cannot deadlock: even ranks send first
        got = torch.zeros_like(mine)
        if rank % 2 == 0:
            ds_comm.send(mine, nxt)
            sender = ds_comm.recv(got, prv)
        else:
            sender = ds_comm.recv(got, prv)
            ds_comm.send(mine, nxt)
        _same(got, from_prev, f"send/recv {dtype}")
        assert sender == prv
        # non-blocking, with a user tag
        got = torch.zeros_like(mine)
        works = [ds_comm.irecv(got, prv, tag=3), ds_comm.isend(mine, nxt, tag=3)]
        for work in works:
            work.wait()
        _same(got, from_prev, f"isend/irecv {dtype}")
        # batched, both directions; accepts torch's isend too
        got_prev, got_next = torch.zeros_like(mine), torch.zeros_like(mine)
        ops = [
            ds_comm.P2POp(ds_comm.isend, mine, nxt),
            ds_comm.P2POp(ds_comm.irecv, got_prev, prv),
            ds_comm.P2POp(torch.distributed.isend, mine, prv),
            ds_comm.P2POp(ds_comm.irecv, got_next, nxt),
        ]
        for work in ds_comm.batch_isend_irecv(ops):
            work.wait()
        _same(got_prev, from_prev, f"batch_isend_irecv {dtype} from prev")
        _same(got_next, _values(nxt, 11, dtype, salt), f"batch_isend_irecv {dtype} from next")
        checks += 4
    if world_size > 1:
        # receive from any source: the returned rank says who sent
        got = torch.zeros(2)
        if rank == 0:
            senders = sorted(ds_comm.recv(got, None) for _ in range(world_size - 1))
            assert senders == list(range(1, world_size)), senders
        else:
            ds_comm.send(torch.full((2,), float(rank)), 0)
        checks += 1
    return checks


def _subgroup_body(rank: int, world_size: int) -> int:
    import torch.distributed as dist

    import ds_comm
    from ds_comm._collectives import force_algorithm

    checks = 0
    # every rank must create every group, members or not
    for members in ([0, 2], [1, 2, 3]):
        group = dist.new_group(members)
        inside = rank in members
        n, me = len(members), members.index(rank) if inside else -1
        for salt, algo in enumerate(("native", "shm", "alltoall", "direct", "ring")):
            with force_algorithm(
                all_gather_into_tensor=algo,
                reduce_scatter_tensor=algo,
                all_to_all_single="native" if algo in ("shm", "alltoall") else "direct",
                all_reduce="upcast" if algo in ("direct", "ring") else "native",
            ):
                mine = _values(rank, 6 * n, "float32", salt)
                everyone = [_values(r, 6 * n, "float32", salt) for r in members]
                t = mine.clone()
                results = [ds_comm.all_reduce(t, group=group)]
                if inside:
                    _same(t, _reference(everyone, "SUM"), f"subgroup {members} all_reduce {algo}")
                out = torch.empty(6 * n * n)
                results.append(ds_comm.all_gather_into_tensor(out, mine, group=group))
                if inside:
                    _same(out, torch.cat(everyone), f"subgroup {members} all_gather {algo}")
                shard = torch.empty(6)
                handle = ds_comm.reduce_scatter_tensor(shard, mine, group=group, async_op=True)
                if inside:
                    handle.wait()
                    ref = _reference(everyone, "SUM")[6 * me : 6 * me + 6]
                    _same(shard, ref, f"subgroup {members} reduce_scatter {algo}")
                out = torch.empty(6 * n)
                results.append(ds_comm.all_to_all_single(out, mine, group=group))
                if inside:
                    expected = torch.cat([e[6 * me : 6 * me + 6] for e in everyone])
                    _same(out, expected, f"subgroup {members} all_to_all {algo}")
                # src/dst are global ranks
                t = mine.clone()
                results.append(ds_comm.broadcast(t, members[-1], group=group))
                if inside:
                    _same(t, everyone[-1], f"subgroup {members} broadcast")
                results.append(ds_comm.barrier(group=group))
                if not inside:  # non-members are no-ops, as in torch
                    assert handle is None
                assert results == [None] * len(results)
                checks += 1
        if inside:  # p2p inside the subgroup, global peer ranks
            peer = members[(me + 1) % n]
            got = torch.zeros(4)
            works = [
                ds_comm.irecv(got, members[(me - 1) % n], group=group),
                ds_comm.isend(torch.full((4,), float(rank)), peer, group=group),
            ]
            for work in works:
                work.wait()
            assert got.tolist() == [float(members[(me - 1) % n])] * 4
        dist.destroy_process_group(group)
    return checks


def _detection_body(rank: int, world_size: int) -> list[str]:
    """gloo has no int16/uint16: the first native call is refused, the fallback takes over."""
    import ds_comm
    from ds_comm import _collectives, _instrument

    algos: list[str] = []
    hook = lambda rec: algos.append(f"{rec.fingerprint.op}:{rec.algo}")  # noqa: E731
    before = set(_collectives._UNSUPPORTED)
    _instrument.TRACKER.on_end.append(hook)
    try:
        for salt, dtype in enumerate(("int16", "uint16")):
            everyone = [_values(r, 9, dtype, salt) for r in range(world_size)]
            for _ in range(2):  # the second call goes straight to the fallback
                t = everyone[rank].clone()
                ds_comm.all_reduce(t)
                _same(t, _reference(everyone, "SUM"), f"all_reduce {dtype}")
            t = _values(rank, 9, dtype, salt)
            ds_comm.broadcast(t, 0)
            _same(t, everyone[0], f"broadcast {dtype}")
            out = torch.empty(9 * world_size, dtype=t.dtype)
            ds_comm.all_to_all_single(out, torch.cat([everyone[rank]] * world_size))
            _same(out, torch.cat(everyone), f"all_to_all_single {dtype}")
        learned = _collectives._UNSUPPORTED - before
        refused = (("gloo", "all_reduce", torch.int16, ds_comm.ReduceOp.SUM), "native")
        assert refused in learned, learned
    finally:
        _instrument.TRACKER.on_end.remove(hook)
        _collectives._UNSUPPORTED.intersection_update(before)  # leave the worker as found
    return algos


def _records_body(rank: int, world_size: int) -> list[tuple[str, int, str]]:
    """What the comms logger is handed: op, nccl-tests message size, algorithm."""
    import torch.distributed as dist

    import ds_comm
    from ds_comm import _instrument

    seen: list[tuple[str, int, str]] = []
    hook = lambda rec: seen.append((rec.fingerprint.op, rec.msg_bytes, rec.algo))  # noqa: E731
    _instrument.TRACKER.on_end.append(hook)
    try:
        shard, full = torch.zeros(8), torch.zeros(8 * world_size)
        ds_comm.all_reduce(full)
        ds_comm.all_gather_into_tensor(full, shard)
        handle = ds_comm.reduce_scatter_tensor(shard, full, async_op=True)
        assert seen[-1][0] == "all_gather_into_tensor", "async call recorded before wait()"
        handle.wait()
        ds_comm.all_to_all_single(full.clone(), full)
        ds_comm.broadcast(shard, 0)
        ds_comm.barrier()
        # barrier really synchronises: the last rank writes late, everyone reads after
        store = dist.distributed_c10d._get_default_store()
        if rank == world_size - 1:
            import time

            time.sleep(0.2)
        store.set(f"test_collectives/barrier/{rank}", "x")
        ds_comm.barrier()
        assert all(store.check([f"test_collectives/barrier/{r}"]) for r in range(world_size))
    finally:
        _instrument.TRACKER.on_end.remove(hook)
    return seen


# --- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_reduce_reduce_broadcast(world_size: int) -> None:
    checks = run_on_ranks(_reductions_body, world_size)
    assert checks == [checks[0]] * world_size and checks[0] > 100


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather(world_size: int) -> None:
    assert min(run_on_ranks(_all_gather_body, world_size)) > 40


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter(world_size: int) -> None:
    assert min(run_on_ranks(_reduce_scatter_body, world_size)) > 200


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_to_all_single(world_size: int) -> None:
    assert min(run_on_ranks(_all_to_all_body, world_size)) == 2 * 4 * 2 * 2


@pytest.mark.parametrize("world_size", [2, 4])
def test_point_to_point(world_size: int) -> None:
    assert run_on_ranks(_p2p_body, world_size) == [21] * world_size


def test_subgroups() -> None:
    counts = run_on_ranks(_subgroup_body, 4)
    assert counts == [10] * 4


@pytest.mark.parametrize("world_size", [1, 2])
def test_unsupported_dtype_detected_once(world_size: int) -> None:
    for algos in run_on_ranks(_detection_body, world_size):
        for dtype_calls in (algos[:4], algos[4:]):
            # refused native all_reduce (not recorded as done), then upcast twice
            assert dtype_calls[:2] == ["all_reduce:upcast", "all_reduce:upcast"], algos
            assert dtype_calls[2] == "broadcast:bytes", algos
            assert dtype_calls[3:] == ["all_to_all_single:direct"], algos


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_records_carry_nccl_tests_sizes(world_size: int) -> None:
    # gloo: all-gather over all-to-all on 2 ranks, reduce-scatter on 2-8 (1 rank: nothing to move)
    gather = "alltoall" if world_size == 2 else "native"
    scatter = "alltoall" if world_size > 1 else "native"
    full = 32 * world_size
    expected = [
        ("all_reduce", full, "native"),
        ("all_gather_into_tensor", full, gather),  # output size
        ("reduce_scatter_tensor", full, scatter),  # input size
        ("all_to_all_single", full, "native"),  # input size
        ("broadcast", 32, "native"),
        ("barrier", 0, "native"),
        ("barrier", 0, "native"),
    ]
    for seen in run_on_ranks(_records_body, world_size):
        assert seen == expected


def test_force_algorithm_rejects_unknown_names() -> None:
    from ds_comm._collectives import _parse_env, force_algorithm
    from ds_comm.api import ConfigError

    with pytest.raises(ConfigError, match="choose from"), force_algorithm(all_reduce="ring"):
        pass
    with (
        pytest.raises(ConfigError, match="not an op"),
        force_algorithm(all_reduce_scatter="native"),
    ):
        pass
    with pytest.raises(ConfigError, match="op=algo"):
        _parse_env("all_reduce")
    assert _parse_env("all_gather=ring, reduce_scatter_tensor=allreduce-slice") == {
        "all_gather": "ring",
        "reduce_scatter_tensor": "allreduce-slice",
    }
