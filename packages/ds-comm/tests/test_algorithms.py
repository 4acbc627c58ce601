"""The algorithm functions of ``_algorithms.py`` on their own: dtype rules, local reduction, byte
views, and the multi-step algorithms called directly with an explicit group (several blocks in
flight, concurrent rings and direct transfers, subgroups)."""

from __future__ import annotations

import functools

import pytest
import torch

from ds_comm import _algorithms as alg
from ds_comm.api import ReduceOp
from ds_testing import run_on_ranks

# --- pure logic ----------------------------------------------------------------------------------


def test_dtype_rules() -> None:
    # gloo cannot reduce these: communicate in a dtype that it can and that holds every value
    assert alg.upcast_dtype(torch.bfloat16) is torch.float32
    assert alg.upcast_dtype(torch.float16) is torch.float32
    assert alg.upcast_dtype(torch.float8_e4m3fn) is torch.float32
    assert alg.upcast_dtype(torch.int16) is torch.int32
    assert alg.upcast_dtype(torch.uint16) is torch.int64
    assert alg.upcast_dtype(torch.float32) is torch.float32
    assert alg.upcast_dtype(torch.int64) is torch.int64
    # torch has no CPU add for these: reduce locally in a wider dtype
    assert alg.accumulate_dtype(torch.uint16) is torch.int64
    assert alg.accumulate_dtype(torch.float8_e5m2) is torch.float32
    assert alg.accumulate_dtype(torch.bfloat16) is torch.bfloat16
    for dtype in (torch.uint16, torch.uint32, torch.float8_e4m3fn):
        wide = alg.accumulate_dtype(dtype)
        torch.ones(3, dtype=wide).add_(torch.ones(3, dtype=dtype).to(wide))  # has kernels


@pytest.mark.parametrize(
    ("op", "reference"),
    [
        (ReduceOp.SUM, torch.add),
        (ReduceOp.PRODUCT, torch.mul),
        (ReduceOp.MIN, torch.minimum),
        (ReduceOp.MAX, torch.maximum),
        (ReduceOp.BAND, torch.bitwise_and),
        (ReduceOp.BOR, torch.bitwise_or),
        (ReduceOp.BXOR, torch.bitwise_xor),
    ],
)
def test_local_reduce_matches_torch(op: ReduceOp, reference: object) -> None:
    gen = torch.Generator().manual_seed(3)
    a = torch.randint(-50, 50, (17,), generator=gen)
    b = torch.randint(-50, 50, (17,), generator=gen)
    acc = a.clone()
    alg.local_reduce(acc, b, op)
    assert torch.equal(acc, reference(a, b))  # type: ignore[operator]
    out = torch.full_like(a, 99)  # the one-pass form into a third tensor leaves a and b alone
    a_before, b_before = a.clone(), b.clone()
    alg.reduce_into(out, a, b, op)
    assert torch.equal(out, reference(a, b))  # type: ignore[operator]
    assert torch.equal(a, a_before) and torch.equal(b, b_before)
    assert op in alg.LOCAL_OPS


def test_local_reduce_rejects_premul_sum() -> None:
    premul = torch.distributed._make_nccl_premul_sum(2.0)
    with pytest.raises(ValueError, match="not supported"):
        alg.local_reduce(torch.ones(2), torch.ones(2), premul)


def test_wire_is_a_byte_view_never_a_copy() -> None:
    t = torch.arange(6, dtype=torch.float32).view(2, 3)
    b = alg.wire(t)
    assert b.dtype == torch.uint8 and b.numel() == 24
    assert b.data_ptr() == t.data_ptr()
    b.zero_()  # writes through: received bytes land in the caller's tensor
    assert not t.any()
    for strided in (torch.zeros(4, 4).t(), torch.zeros(8)[::2]):
        with pytest.raises(RuntimeError):
            alg.wire(strided)


def test_overlaps() -> None:
    buf = torch.zeros(10)
    assert alg.overlaps(buf[2:5], buf)
    assert alg.overlaps(buf[2:5], buf[4:6])
    assert not alg.overlaps(buf[2:5], buf[5:8])
    assert not alg.overlaps(buf, torch.zeros(10))


# --- algorithms on real groups -------------------------------------------------------------------


def _ints(rank: int, numel: int, salt: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(101 * salt + rank)
    return torch.randint(-3, 4, (numel,), generator=gen).to(dtype)


def _blocks_body(rank: int, world_size: int) -> int:
    """Direct reduce-scatter cut into many blocks in flight (uneven sizes, every reduce op)."""
    import torch.distributed as dist

    ranks, checks = tuple(range(world_size)), 0
    sizes = [13 + 5 * r for r in range(world_size)]  # rank r keeps 13+5r elements
    ops = {
        ReduceOp.SUM: torch.add,
        ReduceOp.MAX: torch.maximum,
        ReduceOp.PRODUCT: torch.mul,
        ReduceOp.AVG: None,
    }
    for salt, (op, fn) in enumerate(ops.items()):
        for block_bytes in (4, 12, 1 << 20):  # one element per block, three, everything at once
            inputs = [list(_ints(r, sum(sizes), salt).split(sizes)) for r in range(world_size)]
            mine = [blocks[rank] for blocks in inputs]
            if fn is None:
                expected = torch.stack(mine).sum(0) / world_size
            else:
                expected = functools.reduce(fn, mine)
            out = torch.full((sizes[rank],), 99.0)
            alg.reduce_scatter_direct(
                out,
                inputs[rank],
                op,
                dist.group.WORLD,
                ranks=ranks,
                me=rank,
                block_bytes=block_bytes,
            ).wait()
            assert torch.equal(out, expected), (op, block_bytes, out, expected)
            checks += 1
    return checks


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_reduce_scatter_direct_blocks(world_size: int) -> None:
    assert run_on_ranks(_blocks_body, world_size) == [12] * world_size


def _concurrent_body(rank: int, world_size: int) -> bool:
    """Two rings (helper threads) and a direct all-gather in flight at once, on a subgroup.

    Each ring has its own tag, so their transfers cannot pair up with each other's or with the
    direct algorithm's even though they interleave; see [Note: algorithm tags].
    """
    import torch.distributed as dist

    members = [0, 2, 3] if world_size == 4 else list(range(world_size))
    group = dist.new_group(members)
    try:
        if rank not in members:
            return False
        n, me = len(members), members.index(rank)
        full = [_ints(r, 6 * n, 1) for r in members]
        shard = torch.empty(6)
        ring_rs = alg.reduce_scatter_ring(
            shard,
            list(full[me].split(6)),
            ReduceOp.SUM,
            group,
            ranks=members,
            me=me,
            tag=alg.RING_TAG_BASE + 1,
        )
        gathered = [torch.empty(5) for _ in members]
        ring_ag = alg.all_gather_ring(
            gathered, _ints(rank, 5, 2), group, ranks=members, me=me, tag=alg.RING_TAG_BASE + 2
        )
        direct = [torch.empty(3) for _ in members]
        alg.all_gather_direct(direct, _ints(rank, 3, 3), group, ranks=members, me=me).wait()
        ring_ag.wait()
        ring_rs.wait()
        assert torch.equal(shard, torch.stack(full).sum(0)[6 * me : 6 * me + 6])
        for i, r in enumerate(members):
            assert torch.equal(gathered[i], _ints(r, 5, 2))
            assert torch.equal(direct[i], _ints(r, 3, 3))
        return True
    finally:
        dist.destroy_process_group(group)


@pytest.mark.parametrize("world_size", [2, 4])
def test_rings_and_direct_in_flight_together(world_size: int) -> None:
    took_part = run_on_ranks(_concurrent_body, world_size)
    assert took_part == [r != 1 or world_size == 2 for r in range(world_size)]


def _wait_once_body(rank: int, world_size: int) -> list[float]:
    """Gloo p2p works hang on a second wait(); WaitOnce makes waiting idempotent."""
    import torch.distributed as dist

    peer = 1 - rank
    got = torch.zeros(3)
    recv = alg.WaitOnce(dist.irecv(got, peer))
    send = alg.WaitOnce(dist.isend(torch.full((3,), float(rank)), peer))
    handle = alg.Pending([recv, send])
    for _ in range(2):
        recv.wait()
        send.wait()
        handle.wait()
    assert handle.is_completed()
    return got.tolist()


def test_wait_once() -> None:
    assert run_on_ranks(_wait_once_body, 2, timeout=30) == [[1.0] * 3, [0.0] * 3]


def _alltoall_body(rank: int, world_size: int) -> int:
    """The all-to-all algorithms with uneven sizes per rank, and int16 (no gloo type): bytes."""
    import torch.distributed as dist

    group, ranks, checks = dist.group.WORLD, tuple(range(world_size)), 0
    sizes = [2 * r + 1 for r in range(world_size)]
    for dtype in (torch.float32, torch.int16):
        blocks = [_ints(r, sizes[r], 4, dtype) for r in range(world_size)]
        out = torch.zeros(sum(sizes), dtype=dtype)
        alg.all_gather_alltoall(out, blocks[rank], group, ranks=ranks, me=rank, sizes=sizes).wait()
        assert torch.equal(out, torch.cat(blocks)), (dtype, out)
        inputs = [_ints(r, sum(sizes), 5, dtype) for r in range(world_size)]
        out = torch.zeros(sizes[rank], dtype=dtype)
        alg.reduce_scatter_alltoall(
            out, inputs[rank], ReduceOp.MAX, group, ranks=ranks, me=rank, sizes=sizes
        ).wait()
        mine = [t.split(sizes)[rank] for t in inputs]
        assert torch.equal(out, functools.reduce(torch.maximum, mine)), (dtype, out)
        checks += 2
    return checks


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_alltoall_uneven_and_untyped(world_size: int) -> None:
    assert run_on_ranks(_alltoall_body, world_size) == [4] * world_size
