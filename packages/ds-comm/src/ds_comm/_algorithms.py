"""Collective algorithms as pure functions over an explicit group: fallbacks and faster paths.

Each function issues its communication at once (rings: on a helper thread, as each step needs the
one before) and returns a :class:`Pending` whose ``wait()`` finishes the call (waits the
transfers, runs the local reductions and copies), so every algorithm serves both sync and
``async_op`` callers. Ranks (``ranks``: the group's global ranks in group
order; ``me``: this rank's index in it) are passed in, never read from globals. ``_collectives``
decides which algorithm a call uses; see [Note: choosing an algorithm] there.

[Note: transfers move bytes]
Point-to-point and all-to-all transfers only move bytes, so every transfer here goes through
:func:`wire`, a ``uint8`` view of the tensor. This makes these algorithms dtype-agnostic: gloo has
no type for int16, uint16/32 or float8 (``RuntimeError: Invalid scalar type``), yet their bytes
travel fine. Reductions then happen locally in :func:`accumulate_dtype`, a dtype torch can compute in.

[Note: algorithm tags]
Gloo matches a receive to a send by (peer, tag) in posting order. Algorithm traffic uses its own
tags so it never pairs with a user's ``isend``/``irecv`` (tag 0 by default) in flight at the same
time. Direct algorithms post every transfer from the calling thread in call order, which is the
same order on every rank, so one tag serves all of them. Ring algorithms run on a helper thread
(their steps depend on each other) and so may interleave with later calls: each ring call gets a
tag of its own from the caller (a per-group counter that advances identically on every rank).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

__all__ = [
    "DIRECT_TAG",
    "LOCAL_OPS",
    "RING_TAG_BASE",
    "Pending",
    "WaitOnce",
    "accumulate_dtype",
    "all_gather_alltoall",
    "all_gather_direct",
    "all_gather_pair",
    "all_gather_ring",
    "all_reduce_upcast",
    "all_to_all_direct",
    "average",
    "broadcast_bytes",
    "local_reduce",
    "overlaps",
    "reduce_scatter_allreduce",
    "reduce_scatter_alltoall",
    "reduce_scatter_direct",
    "reduce_scatter_pair",
    "reduce_into",
    "reduce_scatter_ring",
    "reduce_upcast",
    "upcast_dtype",
    "wire",
]

DIRECT_TAG = 0x44530000
RING_TAG_BASE = 0x44540000  # + a per-group counter below 2**16

# Dtypes that gloo (some or all versions) cannot reduce, and the dtype to reduce them in instead.
# Casting back after an integer upcast wraps exactly like the narrow dtype would (two's complement).
_UPCAST = {
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    torch.int16: torch.int32,
    torch.uint16: torch.int64,
    torch.uint32: torch.int64,
}
# Dtypes without CPU arithmetic kernels in torch ("add_stub not implemented for 'UInt16'").
_NO_CPU_MATH = {torch.uint16: torch.int64, torch.uint32: torch.int64}


def upcast_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to communicate a reduction of ``dtype`` in when the backend cannot reduce it."""
    if dtype.is_floating_point and dtype.itemsize == 1:  # the float8 family
        return torch.float32
    return _UPCAST.get(dtype, dtype)


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to reduce ``dtype`` in locally: itself unless torch lacks kernels for it."""
    if dtype.is_floating_point and dtype.itemsize == 1:
        return torch.float32
    return _NO_CPU_MATH.get(dtype, dtype)


def wire(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of contiguous ``t`` for transfer; see [Note: transfers move bytes].

    Raises (``view``'s RuntimeError) rather than copy when ``t`` is not contiguous: data received
    into a copy would be lost.
    """
    return (t if t.dim() == 1 else t.view(-1)).view(torch.uint8)


# The reduce ops that :func:`reduce_into` and :func:`local_reduce` compute.
LOCAL_OPS = (
    ReduceOp.SUM,
    ReduceOp.AVG,
    ReduceOp.PRODUCT,
    ReduceOp.MIN,
    ReduceOp.MAX,
    ReduceOp.BAND,
    ReduceOp.BOR,
    ReduceOp.BXOR,
)


def reduce_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, op: Any) -> None:
    """``out = a (op) b`` elementwise (``out`` may be ``a``); AVG sums (divide once at the end).

    One pass over the data, where :func:`local_reduce` into a fresh accumulator would need a
    copy first.
    """
    if op in (ReduceOp.SUM, ReduceOp.AVG):
        torch.add(a, b, out=out)
    elif op == ReduceOp.PRODUCT:
        torch.mul(a, b, out=out)
    elif op == ReduceOp.MIN:
        torch.minimum(a, b, out=out)
    elif op == ReduceOp.MAX:
        torch.maximum(a, b, out=out)
    elif op == ReduceOp.BAND:
        torch.bitwise_and(a, b, out=out)
    elif op == ReduceOp.BOR:
        torch.bitwise_or(a, b, out=out)
    elif op == ReduceOp.BXOR:
        torch.bitwise_xor(a, b, out=out)
    else:
        raise ValueError(f"reduce op {op} is not supported by ds-comm's fallback algorithms")


def local_reduce(acc: torch.Tensor, other: torch.Tensor, op: Any) -> None:
    """``acc = acc (op) other`` in place; AVG accumulates a sum (the caller divides once at the end)."""
    reduce_into(acc, acc, other, op)


def average(acc: torch.Tensor, n: int) -> None:
    """Divide a summed ``acc`` by ``n`` in place (integers truncate, as gloo's AVG would)."""
    if acc.is_floating_point() or acc.is_complex():
        acc.div_(n)
    else:
        acc.div_(n, rounding_mode="trunc")


def _native_op(op: Any) -> Any:
    # Backends that lack AVG (old gloo) all have SUM; dividing once afterwards is the same result.
    return ReduceOp.SUM if op == ReduceOp.AVG else op


class Pending:
    """Handle of a posted algorithm: ``wait()`` waits ``works``, then runs ``finish`` (once).

    Behaves like a torch work handle for :class:`~ds_comm._instrument.TrackedWork`.
    """

    def __init__(self, works: Sequence[Any] = (), finish: Callable[[], None] | None = None) -> None:
        self._works = list(works)
        self._finish = finish
        self._done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._done:
            return True
        for work in self._works:
            work.wait() if timeout is None else work.wait(timeout)
        if self._finish is not None:
            self._finish()
        self._done = True
        self._works, self._finish = [], None  # see [Note: waited work objects]
        return True

    def is_completed(self) -> bool:
        return self._done or all(work.is_completed() for work in self._works)

    def get_future(self) -> Any:
        raise NotImplementedError("ds-comm multi-step collectives have no future; call wait()")

    def then(self, fn: Callable[[], None]) -> Pending:
        """A handle that finishes this one, then runs ``fn`` (e.g. a copy into the caller's tensor)."""
        return Pending((self,), fn)


class WaitOnce:
    """A work handle that may be waited any number of times.

    Gloo's p2p works must be waited exactly once: a second ``wait()`` waits for another
    completion that never comes. Handles shared between waiters (a batch's members and the
    batch) wrap their works in this.
    """

    def __init__(self, work: Any) -> None:
        self._work: Any = work
        self._waited = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._waited:
            self._work.wait() if timeout is None else self._work.wait(timeout)
            self._waited = True
            self._work = None  # see [Note: waited work objects]
        return True

    def is_completed(self) -> bool:
        return self._waited or self._work.is_completed()

    def get_future(self) -> Any:
        if self._work is None:
            future: torch.futures.Future[Any] = torch.futures.Future()
            future.set_result(None)
            return future
        return self._work.get_future()


class _Threaded(Pending):
    """Runs a multi-step algorithm (a ring) on a helper thread so ``async_op`` callers overlap it."""

    def __init__(self, fn: Callable[[], None], name: str) -> None:
        super().__init__()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the thread that waits
            self._error = exc

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._thread.join(None if timeout is None else timeout.total_seconds())
        if self._thread.is_alive():
            raise RuntimeError(f"{self._thread.name} did not finish within {timeout}")
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return not self._thread.is_alive()


_BATCHED: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _batched(group: Any) -> bool:
    """Whether ``group``'s p2p transfers must be posted as one batch (NCCL); cached per group."""
    pg = dist.group.WORLD if group is None else group
    batched = _BATCHED.get(pg)
    if batched is None:
        batched = _BATCHED[pg] = "nccl" in str(dist.get_backend(pg))
    return batched


def _post(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    group: Any,
    tag: int,
) -> tuple[list[Any], list[Any]]:
    """Post byte transfers to/from global ranks; returns (recv works, send works).

    Receives go first so a peer's data has a destination as it arrives. NCCL needs the transfers
    of one step grouped (or a pair of blocking sends deadlocks), so there they are one batch
    whose works all count as receives.
    """
    if _batched(group):
        ops = [dist.P2POp(dist.irecv, wire(t), peer, group, tag) for t, peer in recvs]
        ops += [dist.P2POp(dist.isend, wire(t), peer, group, tag) for t, peer in sends]
        return (list(dist.batch_isend_irecv(ops)) if ops else []), []
    recv_works = [dist.irecv(wire(t), peer, group, tag) for t, peer in recvs]
    send_works = [dist.isend(wire(t), peer, group, tag) for t, peer in sends]
    return recv_works, send_works


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether contiguous ``a`` and ``b`` share memory (e.g. an in-place reduce-scatter's output
    is the caller's own block of the input)."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


_ALLTOALL_OPTS = dist.AllToAllOptions()


def _alltoall(
    group: Any,
    output: torch.Tensor,
    input: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
) -> Any:
    """Start ``all_to_all_single`` on ``group`` (flat tensors; splits count elements)."""
    pg: Any = dist.group.WORLD if group is None else group
    if hasattr(pg, "alltoall_base"):
        # What torch's all_to_all_single calls, minus its Python wrapper: ~25 us saved per
        # call on a core that has just woken from a wait, which is 10% of a 1 MiB transfer.
        return pg.alltoall_base(output, input, out_splits, in_splits, _ALLTOALL_OPTS)
    return dist.all_to_all_single(output, input, out_splits, in_splits, group=group, async_op=True)


def _copy_unless_same(dst: torch.Tensor, src: torch.Tensor) -> None:
    # In-place callers (FSDP-style) pass the input as a view of their own output slot.
    if dst.data_ptr() != src.data_ptr() or dst.dtype != src.dtype:
        dst.copy_(src.reshape(dst.shape))


class _BlockPending(Pending):
    """A Pending whose ``finish`` waits the works itself (block by block, to overlap reduction)."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._done:
            assert self._finish is not None
            self._finish()
            self._done = True
        return True


# --- all-gather ----------------------------------------------------------------------------------


def all_gather_alltoall(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Any,
    *,
    ranks: Sequence[int],
    me: int,
    sizes: Sequence[int] | None = None,
) -> Pending:
    """All-gather as one all-to-all of bytes into contiguous ``output``.

    ``output`` is every rank's block in group order; rank i's block has ``sizes[i]`` elements
    (default: all as many as ``input``).

    [Note: all-gather and reduce-scatter over all-to-all]
    On one host gloo's allgather and reduce_scatter reach about a third of its allreduce's bus
    bandwidth, while its alltoall, which posts every pairwise transfer at once from C++, moves the
    same bytes 2-4x faster (tools/bench/comm.py, 2 ranks, 1-64 MiB). It also beats p2p
    isend/irecv driven from Python, whose per-transfer handshakes make it erratic on a busy
    machine. An all-gather is an all-to-all whose destinations all get the same block; a
    reduce-scatter is an all-to-all followed by a local reduction of the blocks received. With
    two ranks both are zero-copy (:func:`all_gather_pair`, :func:`reduce_scatter_pair`): the
    block for the peer goes straight from the input and arrives straight in the output (split
    sizes of 0 for this rank itself). With more ranks the all-gather sends its block repeated
    once per rank, and reduce-scatter receives n blocks into scratch and reduces them in one
    pass. Bytes travel as ``uint8`` (see [Note: transfers move bytes]), so any dtype works.
    Python work is kept to a few tensor ops: each costs microseconds when a rank wakes from
    waiting, which is the common case.
    """
    n = len(ranks)
    source = wire(input)
    target = wire(output)
    mine = source.numel()
    if n == 2:
        theirs = target.numel() - mine  # rank 0's block comes first
        own = target.narrow(0, 0 if me == 0 else theirs, mine)
        return all_gather_pair(
            own, target[mine:] if me == 0 else target[:theirs], input, group, me=me
        )
    blocks = [mine] * n if sizes is None else [s * output.element_size() for s in sizes]
    return Pending([_alltoall(group, target, source.repeat(n), blocks, [mine] * n)])


def all_gather_pair(
    own: torch.Tensor, theirs: torch.Tensor, input: torch.Tensor, group: Any, *, me: int
) -> Pending:
    """Two-rank all-gather: ``input`` goes to the peer and to ``own``; the peer's to ``theirs``.

    ``own`` and ``theirs`` are contiguous (any shapes, or byte views); ``own`` may be ``input``
    itself (in place).
    """
    source, landing = wire(input), wire(theirs)
    send, recv = [0, 0], [0, 0]
    send[1 - me], recv[1 - me] = source.numel(), landing.numel()
    work = _alltoall(group, landing, source, recv, send)
    own = wire(own)
    if own.data_ptr() != source.data_ptr():
        own.copy_(source)
    return Pending([work])


def all_gather_direct(
    outputs: Sequence[torch.Tensor],
    input: torch.Tensor,
    group: Any,
    *,
    ranks: Sequence[int],
    me: int,
) -> Pending:
    """Every rank sends its input straight to every peer; ``outputs[i]`` (contiguous) get rank i's.

    Total traffic is the ring's ((n-1)/n of the output per rank) but in one step, with no
    intermediate copies; sizes may differ per rank. Best for the few ranks of one host.
    """
    n = len(ranks)
    # Staggered peer order (me+1, me+2, ...) so no rank is everyone's first destination.
    peers = [(me + k) % n for k in range(1, n)]
    recv_works, send_works = _post(
        [(input, ranks[p]) for p in peers],
        [(outputs[(me - k) % n], ranks[(me - k) % n]) for k in range(1, n)],
        group,
        DIRECT_TAG,
    )
    _copy_unless_same(outputs[me], input)
    return Pending(recv_works + send_works)


def all_gather_ring(
    outputs: Sequence[torch.Tensor],
    input: torch.Tensor,
    group: Any,
    *,
    ranks: Sequence[int],
    me: int,
    tag: int,
) -> Pending:
    """Ring all-gather over p2p: n-1 steps, each forwarding the block received last step.

    Each rank only talks to its ring neighbours, so per-link traffic is optimal across hosts.
    """
    n = len(ranks)
    nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
    _copy_unless_same(outputs[me], input)

    def steps() -> None:
        for k in range(n - 1):
            recv_works, send_works = _post(
                [(outputs[(me - k) % n], nxt)], [(outputs[(me - k - 1) % n], prv)], group, tag
            )
            for work in recv_works + send_works:
                work.wait()

    return _Threaded(steps, "ds-comm-ring-all-gather")


# --- reduce-scatter ------------------------------------------------------------------------------

_BLOCK_BYTES = 1 << 20


def reduce_scatter_alltoall(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any,
    group: Any,
    *,
    ranks: Sequence[int],
    me: int,
    sizes: Sequence[int] | None = None,
) -> Pending:
    """Reduce-scatter as one all-to-all of bytes plus a local reduction of the blocks received.

    ``input`` (contiguous) is every destination's block in group order, rank i's with
    ``sizes[i]`` elements (default: all as many as ``output``); ``output`` (contiguous) gets the
    reduction of every rank's block for this rank. See [Note: all-gather and reduce-scatter over
    all-to-all].
    """
    n = len(ranks)
    acc_dtype = accumulate_dtype(output.dtype)
    if n == 2 and acc_dtype == output.dtype:
        flat = input.view(-1)
        mine = output.numel()
        theirs = flat.numel() - mine  # rank 0's block comes first
        own = flat.narrow(0, 0 if me == 0 else theirs, mine)
        to_peer = flat[mine:] if me == 0 else flat[:theirs]
        in_place = overlaps(output, input)
        return reduce_scatter_pair(output, own, to_peer, op, group, me=me, in_place=in_place)
    target, source = wire(output), wire(input)
    mine = target.numel()
    blocks = [mine] * n if sizes is None else [s * output.element_size() for s in sizes]
    scratch = output.new_empty((n, output.numel()))
    work = _alltoall(group, wire(scratch), source, [mine] * n, blocks)

    def finish() -> None:
        received = scratch.to(acc_dtype)
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            acc = received.sum(0, dtype=acc_dtype)  # one pass over the n blocks
        else:
            acc = received[0].clone()
            for i in range(1, n):
                local_reduce(acc, received[i], op)
        if op == ReduceOp.AVG:
            average(acc, n)
        output.view(-1).copy_(acc)

    return Pending([work], finish)


def reduce_scatter_pair(
    output: torch.Tensor,
    own: torch.Tensor,
    to_peer: torch.Tensor,
    op: Any,
    group: Any,
    *,
    me: int,
    in_place: bool | None = None,
) -> Pending:
    """Two-rank reduce-scatter: send ``to_peer``, receive the peer's block for this rank, and
    reduce ``own`` into it. All contiguous; ``output`` may be (part of) the input (in place).

    ``output``'s dtype must have CPU kernels (see :func:`accumulate_dtype`). ``in_place``, when
    the caller knows, says whether ``output`` overlaps ``own`` or ``to_peer``.
    """
    target = wire(output)
    send, recv = [0, 0], [0, 0]
    send[1 - me], recv[1 - me] = to_peer.numel() * to_peer.element_size(), target.numel()
    # The peer's block lands in the output, unless that is (part of) the input: in place.
    if in_place is None:
        in_place = overlaps(output, own) or overlaps(output, to_peer)
    landing = torch.empty_like(target) if in_place else target
    work = _alltoall(group, landing, wire(to_peer), recv, send)

    def add_own() -> None:
        result = landing.view(output.dtype)
        local_reduce(result, own.reshape(-1), op)
        if op == ReduceOp.AVG:
            average(result, 2)
        if in_place:
            target.copy_(landing)

    return Pending([work], add_own)


def reduce_scatter_direct(
    output: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    op: Any,
    group: Any,
    *,
    ranks: Sequence[int],
    me: int,
    block_bytes: int = _BLOCK_BYTES,
) -> Pending:
    """Every rank sends ``inputs[p]`` straight to rank p and reduces what it receives, block by block.

    ``output`` (contiguous) gets the reduction of every rank's ``inputs[me]``; sizes may differ
    per destination. Transfers are cut into ``block_bytes`` blocks, all posted at once, so
    reducing one block overlaps receiving the next. With two ranks and a computable dtype the
    peer's block lands in ``output`` itself: no scratch memory at all.
    """
    n = len(ranks)
    numel = output.numel()
    block = max(1, block_bytes // max(1, output.element_size()))
    acc_dtype = accumulate_dtype(output.dtype)
    own = inputs[me].reshape(-1)
    flat_out = output.view(-1)
    in_place = (
        n == 2
        and acc_dtype == output.dtype
        and op != ReduceOp.AVG
        and not any(overlaps(output, t) for t in inputs)
    )
    peers = [(me - k) % n for k in range(1, n)]  # receive order; senders stagger the same way
    scratch = None if in_place else output.new_empty((n - 1, numel))
    starts = range(0, max(numel, 1), block)
    recvs = []
    for start in starts:
        stop = min(start + block, numel)
        bufs = [flat_out[start:stop]] if scratch is None else list(scratch[:, start:stop])
        recvs += zip(bufs, [ranks[p] for p in peers])
    sends = []
    for k in range(1, n):
        p = (me + k) % n
        chunk = inputs[p].reshape(-1)
        # Same dtype on every rank, so the receiver cuts this chunk into the same blocks.
        sends += [(chunk[s : s + block], ranks[p]) for s in range(0, max(chunk.numel(), 1), block)]
    recv_all, send_all = _post(sends, recvs, group, DIRECT_TAG)
    if len(recv_all) == len(recvs):
        per_block = [recv_all[i * (n - 1) : (i + 1) * (n - 1)] for i in range(len(starts))]
    else:  # one NCCL batch: all blocks arrive together
        per_block = [recv_all] + [[] for _ in starts[1:]]
    recv_blocks = list(zip(starts, per_block))

    def finish() -> None:
        for start, works in recv_blocks:
            for work in works:
                work.wait()
            stop = min(start + block, numel)
            if scratch is None:
                local_reduce(flat_out[start:stop], own[start:stop], op)
                continue
            acc = own[start:stop].to(acc_dtype, copy=True)
            for i in range(n - 1):
                local_reduce(acc, scratch[i, start:stop].to(acc_dtype), op)
            if op == ReduceOp.AVG:
                average(acc, n)
            flat_out[start:stop].copy_(acc)
        for work in send_all:
            work.wait()

    return _BlockPending(recv_all + send_all, finish)


def reduce_scatter_ring(
    output: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    op: Any,
    group: Any,
    *,
    ranks: Sequence[int],
    me: int,
    tag: int,
) -> Pending:
    """Ring reduce-scatter over p2p: n-1 steps, each adding the partial received to the own block.

    After step k a rank holds the partial reduction of block ``(me-k-2) % n`` over k+2 ranks;
    the last one is its own block, fully reduced. Partials travel in the accumulation dtype.
    """
    n = len(ranks)
    nxt, prv = ranks[(me + 1) % n], ranks[(me - 1) % n]
    acc_dtype = accumulate_dtype(output.dtype)

    def steps() -> None:
        acc = inputs[(me - 1) % n].reshape(-1).to(acc_dtype, copy=True)
        for k in range(n - 1):
            j = (me - k - 2) % n
            incoming = output.new_empty(inputs[j].numel(), dtype=acc_dtype)
            recv_works, send_works = _post([(acc, nxt)], [(incoming, prv)], group, tag)
            for work in recv_works + send_works:
                work.wait()
            local_reduce(incoming, inputs[j].reshape(-1).to(acc_dtype), op)
            acc = incoming
        if op == ReduceOp.AVG:
            average(acc, n)
        output.view(-1).copy_(acc)

    if n == 1:
        return Pending(finish=steps)  # no peers: nothing to overlap, no thread
    return _Threaded(steps, "ds-comm-ring-reduce-scatter")


def reduce_scatter_allreduce(
    output: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    op: Any,
    group: Any,
    *,
    me: int,
    comm_dtype: torch.dtype,
) -> Pending:
    """One all-reduce of all blocks (in ``comm_dtype``), then keep the own block.

    Needs only all_reduce from the backend; moves ~2x the data of a reduce-scatter.
    """
    flat = torch.cat([t.reshape(-1).to(comm_dtype) for t in inputs])
    offset = sum(t.numel() for t in inputs[:me])
    work = dist.all_reduce(flat, op=_native_op(op), group=group, async_op=True)

    def finish() -> None:
        mine = flat[offset : offset + output.numel()]
        if op == ReduceOp.AVG:
            average(mine, len(inputs))
        output.view(-1).copy_(mine)

    return Pending([work], finish)


# --- reductions in a wider dtype -----------------------------------------------------------------


def all_reduce_upcast(
    tensor: torch.Tensor, op: Any, group: Any, *, comm_dtype: torch.dtype, n: int
) -> Pending:
    """All-reduce a ``comm_dtype`` copy (e.g. fp32 for bf16) and cast the result back into ``tensor``.

    The result is rounded once instead of at every step, so it is at least as accurate as a
    native low-precision reduction.
    """
    wide = tensor.to(comm_dtype, copy=True)
    work = dist.all_reduce(wide, op=_native_op(op), group=group, async_op=True)

    def finish() -> None:
        if op == ReduceOp.AVG:
            average(wide, n)
        tensor.copy_(wide)

    return Pending([work], finish)


def reduce_upcast(
    tensor: torch.Tensor,
    dst: int,
    op: Any,
    group: Any,
    *,
    comm_dtype: torch.dtype,
    n: int,
    is_dst: bool,
) -> Pending:
    """Reduce a ``comm_dtype`` copy to global rank ``dst``; only ``dst``'s tensor is written."""
    wide = tensor.to(comm_dtype, copy=True)
    work = dist.reduce(wide, dst, op=_native_op(op), group=group, async_op=True)

    def finish() -> None:
        if is_dst:
            if op == ReduceOp.AVG:
                average(wide, n)
            tensor.copy_(wide)

    return Pending([work], finish)


# --- data movement -------------------------------------------------------------------------------


def broadcast_bytes(tensor: torch.Tensor, src: int, group: Any) -> Pending:
    """Broadcast the bytes of contiguous ``tensor`` (for dtypes the backend has no type for)."""
    return Pending([dist.broadcast(wire(tensor), src, group=group, async_op=True)])


def all_to_all_direct(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    group: Any,
    *,
    ranks: Sequence[int],
    me: int,
) -> Pending:
    """All-to-all over p2p: ``inputs[p]`` goes to rank p, ``outputs[p]`` (contiguous) comes from it."""
    n = len(ranks)
    recv_works, send_works = _post(
        [(inputs[(me + k) % n], ranks[(me + k) % n]) for k in range(1, n)],
        [(outputs[(me - k) % n], ranks[(me - k) % n]) for k in range(1, n)],
        group,
        DIRECT_TAG,
    )
    _copy_unless_same(outputs[me], inputs[me])
    return Pending(recv_works + send_works)
