"""The public collectives: ``torch.distributed``'s signatures, each call tracked, the best algorithm.

Every op goes through :func:`ds_comm._instrument.tracked` with its message size (nccl-tests
convention, which the comms logger turns into algbw/busbw) and the name of the algorithm used.
``src``/``dst``/``peer`` are global ranks, as in torch; ``group=None`` is the default group.

[Note: choosing an algorithm]
Per call:

1. A forced algorithm, used as is: ``force_algorithm(op=algo)`` (a context manager) or
   ``DS_COMM_FORCE_ALGO="op=algo,..."`` (read at the first call). Tests and benchmarks pin
   algorithms this way, including fallbacks that the running torch never needs.
2. Otherwise the fastest algorithm measured for the backend (``tools/bench/comm.py``). On gloo,
   all-gather and reduce-scatter (both forms) of ``SHM_MIN_BYTES`` (64 KiB of all-gather output
   or reduce-scatter input) and up on CPU tensors, between ranks that all run on one x86-64
   host (checked once per group), go through shared memory (see [Note: shared-memory
   all-gather] and [Note: shared-memory reduce-scatter] in ``_shm.py``): no socket at all. On
   2 ranks they measured 2.2-6x torch's from 1 MiB up (the all-to-all below reached only
   1.3-3x, short of 1.5x for the list all-gather at 1 MiB), and on 4 ranks 3-9x torch's,
   where the all-to-all reduce-scatter reached 1-3x. Below 64 KiB per-call overhead decides:
   reduce-scatter between 2 and 8 ranks and all-gather on 2 ranks go over one all-to-all (see
   [Note: all-gather and reduce-scatter over all-to-all] in ``_algorithms.py``). With more
   ranks an all-to-all all-gather must copy its block once per rank, and it measured no faster
   than gloo's own on 4 ranks, so small ones stay native; above 8 ranks (several hosts) gloo's
   ring, with fewer and larger messages per link, is kept. Small uneven or strided
   all-gather/reduce-scatter lists take the all-to-all on gloo, whose own refuse them. NCCL's
   native ops are optimal, and every other op is native.
3. A fallback when the backend refuses that algorithm for this dtype and reduce op ("Invalid
   scalar type", "does not support ..."): the next one in ``_FALLBACKS``, which keep the
   bandwidth order of the op they replace (never gather-to-rank-0): all-reduce and reduce in a
   wider dtype (bf16/fp16 in fp32, int16 in int32); broadcast as bytes; all-gather and
   reduce-scatter over all-to-all, then over p2p; all-to-all over p2p. Nothing is assumed up
   front: the first use of an algorithm per (backend, op, dtype, reduce op) is waited before
   returning, even when async, because gloo reports some refusals only through the work; the
   verdict is cached, and a refused call runs again as a new tracked call (every rank meets the
   same refusal, before any transfer, so all advance their sequence numbers alike).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import re
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ds_comm import _algorithms as alg
from ds_comm import _shm
from ds_comm._instrument import TrackedWork, tracked
from ds_comm.api import ConfigError, ReduceOp

__all__ = [
    "ALGORITHMS",
    "FORCE_ENV",
    "SHM_MIN_BYTES",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "force_algorithm",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
]

# The algorithms each op can run (any can be forced). Those in _FALLBACKS are also tried, in
# order, when the backend refuses the ones before them; the rest are for tests and benchmarks.
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("native", "upcast"),
    "reduce": ("native", "upcast"),
    "broadcast": ("native", "bytes"),
    "all_gather": ("native", "shm", "alltoall", "direct", "ring"),
    "all_gather_into_tensor": ("native", "shm", "alltoall", "direct", "ring"),
    "reduce_scatter": ("native", "shm", "alltoall", "direct", "ring", "allreduce-slice"),
    "reduce_scatter_tensor": ("native", "shm", "alltoall", "direct", "ring", "allreduce-slice"),
    "all_to_all_single": ("native", "direct"),
    "all_to_all": ("native", "direct"),
    "gather": ("native",),
    "scatter": ("native",),
}
_FALLBACKS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("native", "upcast"),
    "reduce": ("native", "upcast"),
    "broadcast": ("native", "bytes"),
    "all_gather": ("native", "alltoall", "direct"),
    "all_gather_into_tensor": ("native", "alltoall", "direct"),
    "reduce_scatter": ("native", "alltoall", "direct"),
    "reduce_scatter_tensor": ("native", "alltoall", "direct"),
    "all_to_all_single": ("native", "direct"),
    "all_to_all": ("native", "direct"),
    "gather": ("native",),
    "scatter": ("native",),
}
FORCE_ENV = "DS_COMM_FORCE_ALGO"

# Largest group whose gloo reduce-scatter goes over all-to-all (one host).
_ALLTOALL_MAX_RANKS = 8
# Smallest all-gather output / reduce-scatter input that goes through shared memory on one host
# (gloo, x86-64).
SHM_MIN_BYTES = 64 << 10
_FORCED: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "ds_comm_forced_algorithms", default=None
)
# ((backend, op, dtype, reduce op), algorithm) pairs the backend refused / ran.
_UNSUPPORTED: set[tuple[tuple[Any, ...], str]] = set()
_SUPPORTED: set[tuple[tuple[Any, ...], str]] = set()
# Refusals, as worded by gloo ("Invalid scalar type"), NCCL and c10d ("... does not support ...").
_CAPABILITY_ERROR = re.compile(
    r"invalid scalar type|not supported|unsupported|does not support|not implemented"
    r"|cannot use reduceop\.avg",
    re.IGNORECASE,
)
_RING_CALLS: dict[tuple[int, ...], int] = {}
# Per process group (weakly held: a destroyed group's entry goes with it).
_GROUPS: weakref.WeakKeyDictionary[Any, _Member] = weakref.WeakKeyDictionary()


class _Unsupported(Exception):
    """The backend refused an algorithm for this op, dtype or reduce op (before any transfer)."""


# --- algorithm choice ----------------------------------------------------------------------------


def _check(algos: Mapping[str, str], where: str) -> dict[str, str]:
    for op, algo in algos.items():
        if op not in ALGORITHMS:
            raise ConfigError(
                f"{where}: {op!r} is not an op with algorithms; ops: {sorted(ALGORITHMS)}"
            )
        if algo not in ALGORITHMS[op]:
            raise ConfigError(
                f"{where}: {op} has no algorithm {algo!r}; choose from {ALGORITHMS[op]}"
            )
    return dict(algos)


@functools.lru_cache(maxsize=8)
def _parse_env(raw: str) -> dict[str, str]:
    pairs = [item.split("=", 1) for item in raw.replace(" ", "").split(",") if item]
    if any(len(pair) != 2 for pair in pairs):
        raise ConfigError(f"{FORCE_ENV}={raw!r}: expected 'op=algo,op=algo'")
    return _check(dict(pairs), FORCE_ENV)


@contextlib.contextmanager
def force_algorithm(**algos: str) -> Iterator[None]:
    """Run the named ops with the named algorithms inside the block (tests, benchmarks).

    Every rank of the group must force the same algorithms. Valid names are in ``ALGORITHMS``.

    Example:
        >>> with force_algorithm(reduce_scatter_tensor="ring", all_reduce="upcast"):
        ...     reduce_scatter_tensor(shard, full)
    """
    token = _FORCED.set({**(_FORCED.get() or {}), **_check(algos, "force_algorithm")})
    try:
        yield
    finally:
        _FORCED.reset(token)


@functools.cache
def _env_forced() -> dict[str, str]:
    # Read once per process: a cold environment lookup costs microseconds on every call.
    raw = os.environ.get(FORCE_ENV, "")
    return _parse_env(raw) if raw else {}


def _forced(op: str) -> str | None:
    forced = _FORCED.get()
    algo = forced.get(op) if forced else None
    return algo if algo is not None else _env_forced().get(op)


class _Member(NamedTuple):
    """A call's view of its group."""

    ranks: tuple[int, ...]  # global ranks, in group order
    me: int  # this rank's index in ``ranks``
    backend: str  # e.g. "gloo", for the call's device


def _member(group: Any, tensor: torch.Tensor | None = None) -> _Member | None:
    """This rank's view of ``group`` (cached per group), or None when not a member (a no-op)."""
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return None
    pg = dist.group.WORLD if group is None else group
    member = _GROUPS.get(pg)
    if member is None:
        ranks = tuple(dist.get_process_group_ranks(pg))
        me = dist.get_rank()
        member = _Member(ranks, ranks.index(me) if me in ranks else -1, str(dist.get_backend(pg)))
        _GROUPS[pg] = member
    if member.me < 0:
        return None
    if ":" in member.backend:  # e.g. "cpu:gloo,cuda:nccl": the tensor's device picks
        table = dict(part.split(":", 1) for part in member.backend.split(","))
        device = tensor.device.type if tensor is not None else "cpu"
        return member._replace(backend=table.get(device, member.backend))
    return member


def _prefer_fast(member: _Member, gather: bool) -> str:
    """The algorithm for all-gather / reduce-scatter: see [Note: choosing an algorithm]."""
    n = len(member.ranks)
    most = 2 if gather else _ALLTOALL_MAX_RANKS
    return "alltoall" if member.backend == "gloo" and 2 <= n <= most else "native"


def _prefer_shm(group: Any, member: _Member, tensors: Sequence[torch.Tensor], nbytes: int) -> bool:
    """Whether an all-gather takes the shared-memory path: see [Note: choosing an algorithm]."""
    if member.backend != "gloo" or len(member.ranks) < 2 or nbytes < SHM_MIN_BYTES:
        return False
    if not _shm.SUPPORTED or any(t.device.type != "cpu" for t in tensors):
        return False
    return _shm.shm_group(group, member.ranks, member.me).same_host


def _ring_tag(ranks: tuple[int, ...]) -> int:
    # See [Note: algorithm tags] in _algorithms.py: advances identically on every member.
    count = _RING_CALLS.get(ranks, 0)
    _RING_CALLS[ranks] = count + 1
    return alg.RING_TAG_BASE + count % (1 << 16)


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.nbytes for t in tensors)


def _run(
    op: str,
    group: Any,
    member: _Member,
    tensors: Sequence[torch.Tensor],
    msg_bytes: int,
    async_op: bool,
    issue: Callable[[str], Any],
    *,
    preferred: str = "native",
    redop: Any = None,
) -> TrackedWork | None:
    """Issue ``op`` as a tracked call with the algorithm chosen per [Note: choosing an algorithm]."""

    def call(algo: str, run: Callable[[], Any]) -> TrackedWork | None:
        return tracked(
            op, group, tensors, msg_bytes=msg_bytes, algo=algo, async_op=async_op, run=run
        )

    forced = _forced(op)
    if forced is not None:
        return call(forced, lambda: issue(forced))
    key = _key(member.backend, op, tensors[0].dtype, redop)
    if (key, preferred) in _SUPPORTED:  # the common case, kept short: it ran here before
        return call(preferred, lambda: issue(preferred))
    chain = [preferred, *(a for a in _FALLBACKS[op] if a != preferred)]
    candidates = [a for a in chain if (key, a) not in _UNSUPPORTED] or chain[-1:]
    for algo in candidates[:-1]:
        try:
            return call(algo, functools.partial(_probe, key, algo, issue))
        except _Unsupported:
            _UNSUPPORTED.add((key, algo))
    last = candidates[-1]  # nothing left to fall back to: its errors are the caller's
    return call(last, lambda: issue(last))


_RED_OP_TYPE = type(ReduceOp.SUM)  # a hashable enum; other ReduceOp forms are keyed by str


def _key(backend: str, op: str, dtype: torch.dtype, redop: Any) -> tuple[Any, ...]:
    """What a backend's support verdict is cached under."""
    return (backend, op, dtype, redop if type(redop) is _RED_OP_TYPE else str(redop))


def _probe(key: tuple[Any, ...], algo: str, issue: Callable[[str], Any]) -> Any:
    """Issue ``algo``; a backend refusal becomes :class:`_Unsupported` (so the caller falls back)."""
    try:
        work = issue(algo)
        if (key, algo) not in _SUPPORTED:
            work.wait()  # first use: gloo reports some refusals only through the work
            _SUPPORTED.add((key, algo))
        return work
    except (RuntimeError, NotImplementedError) as exc:
        if _CAPABILITY_ERROR.search(str(exc)):
            raise _Unsupported(str(exc)) from exc
        raise


def _contiguous_outputs(
    outputs: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor], Callable[[], None] | None]:
    """Contiguous stand-ins for ``outputs`` and the copy-back that fills the originals."""
    staged = [
        t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)
        for t in outputs
    ]
    pairs = [(t, s) for t, s in zip(outputs, staged) if s is not t]
    if not pairs:
        return staged, None

    def copy_back() -> None:
        for t, s in pairs:
            t.copy_(s)

    return staged, copy_back


def _then(pending: alg.Pending, fn: Callable[[], None] | None) -> alg.Pending:
    return pending if fn is None else pending.then(fn)


# --- reductions and broadcast --------------------------------------------------------------------


def all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> TrackedWork | None:
    """Reduce ``tensor`` across the group in place; every rank gets the result.

    Example:
        >>> grad = torch.ones(4)
        >>> ds_comm.all_reduce(grad)  # grad == world_size everywhere
    """
    if (member := _member(group, tensor)) is None:
        return None

    def issue(algo: str) -> Any:
        if algo == "native":
            return dist.all_reduce(tensor, op=op, group=group, async_op=True)
        return alg.all_reduce_upcast(
            tensor, op, group, comm_dtype=alg.upcast_dtype(tensor.dtype), n=len(member.ranks)
        )

    return _run("all_reduce", group, member, [tensor], tensor.nbytes, async_op, issue, redop=op)


def reduce(
    tensor: torch.Tensor,
    dst: int,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> TrackedWork | None:
    """Reduce ``tensor`` across the group into global rank ``dst`` (other ranks' data is untouched
    by the fallback and unspecified natively, as in torch)."""
    if (member := _member(group, tensor)) is None:
        return None

    def issue(algo: str) -> Any:
        if algo == "native":
            return dist.reduce(tensor, dst, op=op, group=group, async_op=True)
        return alg.reduce_upcast(
            tensor,
            dst,
            op,
            group,
            comm_dtype=alg.upcast_dtype(tensor.dtype),
            n=len(member.ranks),
            is_dst=member.ranks[member.me] == dst,
        )

    return _run("reduce", group, member, [tensor], tensor.nbytes, async_op, issue, redop=op)


def broadcast(
    tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False
) -> TrackedWork | None:
    """Copy ``tensor`` from global rank ``src`` to every rank of the group."""
    if (member := _member(group, tensor)) is None:
        return None

    def issue(algo: str) -> Any:
        if algo == "native":
            return dist.broadcast(tensor, src, group=group, async_op=True)
        return alg.broadcast_bytes(tensor, src, group)

    return _run("broadcast", group, member, [tensor], tensor.nbytes, async_op, issue)


# --- all-gather ----------------------------------------------------------------------------------


def _gather_algorithm(
    algo: str,
    outputs: Sequence[torch.Tensor],
    tensor: torch.Tensor,
    group: Any,
    member: _Member,
) -> alg.Pending:
    """Run a non-native all-gather into the list ``outputs`` (any strides, sizes per rank)."""
    source = tensor.contiguous()
    ranks, me = member.ranks, member.me
    if algo == "shm":
        staged, copy_back = _contiguous_outputs(outputs)
        state = _shm.shm_group(group, ranks, me)
        pending = state.all_gather(staged, source, "all_gather")
        if pending is not None:
            return _then(pending, copy_back)
        algo = "alltoall"  # every rank alike: no segment could hold this message
    pair = len(ranks) == 2 and all(t.is_contiguous() for t in outputs)
    if algo == "alltoall" and pair:  # zero-copy: straight into the caller's tensors
        return alg.all_gather_pair(outputs[me], outputs[1 - me], source, group, me=me)
    if algo == "alltoall":  # lands in one flat buffer, then is copied out
        sizes = [t.numel() for t in outputs]
        flat = torch.empty(sum(sizes), dtype=tensor.dtype, device=tensor.device)
        pending = alg.all_gather_alltoall(flat, source, group, ranks=ranks, me=me, sizes=sizes)

        def scatter_out() -> None:
            for t, part in zip(outputs, flat.split(sizes)):
                t.copy_(part.view(t.shape))

        return pending.then(scatter_out)
    staged, copy_back = _contiguous_outputs(outputs)
    if algo == "ring":
        pending = alg.all_gather_ring(
            staged, source, group, ranks=ranks, me=me, tag=_ring_tag(ranks)
        )
    else:
        pending = alg.all_gather_direct(staged, source, group, ranks=ranks, me=me)
    return _then(pending, copy_back)


def all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False
) -> TrackedWork | None:
    """Gather every rank's ``tensor`` into ``tensor_list`` (one entry per group rank, in order).

    Entries may differ in size between ranks (``tensor_list[i]`` matches rank i's ``tensor``),
    also on gloo, whose native all_gather needs equal sizes.
    """
    if (member := _member(group, tensor)) is None:
        return None
    if len(tensor_list) != len(member.ranks):
        raise ValueError(
            f"all_gather: tensor_list has {len(tensor_list)} entries, "
            f"group has {len(member.ranks)} ranks"
        )
    preferred = _prefer_fast(member, gather=True)
    uniform = all(t.shape == tensor.shape and t.is_contiguous() for t in tensor_list)
    if member.backend == "gloo" and not uniform:
        preferred = "alltoall"  # gloo's own cannot take uneven or strided outputs
    if _prefer_shm(group, member, [tensor, *tensor_list], _nbytes(tensor_list)):
        preferred = "shm"

    def issue(algo: str) -> Any:
        if algo == "native":
            return dist.all_gather(tensor_list, tensor, group=group, async_op=True)
        return _gather_algorithm(algo, tensor_list, tensor, group, member)

    return _run(
        "all_gather",
        group,
        member,
        [tensor, *tensor_list],
        _nbytes(tensor_list),
        async_op,
        issue,
        preferred=preferred,
    )


def all_gather_into_tensor(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
) -> TrackedWork | None:
    """Gather every rank's ``input_tensor`` into ``output_tensor``, concatenated in group-rank order.

    Example:
        >>> full = torch.empty(world_size * shard.numel())
        >>> ds_comm.all_gather_into_tensor(full, shard)
    """
    if (member := _member(group, input_tensor)) is None:
        return None
    n = len(member.ranks)

    def issue(algo: str) -> Any:
        if algo == "native":
            return dist.all_gather_into_tensor(
                output_tensor, input_tensor, group=group, async_op=True
            )
        if output_tensor.numel() != n * input_tensor.numel():
            raise ValueError(
                f"all_gather_into_tensor: output must have {n} x {input_tensor.numel()} elements,"
                f" got {tuple(output_tensor.shape)}"
            )
        if algo == "shm":  # one buffer: no per-block views (see _shm.ShmGroup.all_gather)
            staged, copy_back = _contiguous_outputs([output_tensor])
            state = _shm.shm_group(group, member.ranks, member.me)
            pending = state.all_gather(
                staged[0], input_tensor.contiguous(), "all_gather_into_tensor"
            )
            if pending is not None:
                return _then(pending, copy_back)
            algo = "alltoall"  # every rank alike: no segment could hold this message
        if algo == "alltoall":  # straight into the caller's buffer
            return alg.all_gather_alltoall(
                output_tensor, input_tensor.contiguous(), group, ranks=member.ranks, me=member.me
            )
        chunks = list(output_tensor.view(-1).split(input_tensor.numel()))
        return _gather_algorithm(algo, chunks, input_tensor.reshape(-1), group, member)

    tensors = [output_tensor, input_tensor]
    if _prefer_shm(group, member, tensors, output_tensor.nbytes):
        preferred = "shm"
    else:
        preferred = _prefer_fast(member, gather=True)
    return _run(
        "all_gather_into_tensor",
        group,
        member,
        tensors,
        output_tensor.nbytes,
        async_op,
        issue,
        preferred=preferred,
    )


# --- reduce-scatter ------------------------------------------------------------------------------


def _scatter_algorithm(
    algo: str,
    output: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    op: Any,
    group: Any,
    member: _Member,
) -> alg.Pending:
    """Run a non-native reduce-scatter of the blocks ``inputs`` (sizes per destination rank)."""
    staged, copy_back = _contiguous_outputs([output])
    target = staged[0]
    ranks, me = member.ranks, member.me
    if algo == "shm":
        state = _shm.shm_group(group, ranks, me)
        pending = state.reduce_scatter(
            target, [t.contiguous() for t in inputs], op, "reduce_scatter"
        )
        if pending is not None:
            return _then(pending, copy_back)
        algo = "alltoall"  # every rank alike: no segment could hold this message
    pair = len(ranks) == 2 and alg.accumulate_dtype(output.dtype) == output.dtype
    if algo == "alltoall" and pair:  # zero-copy: straight from the caller's tensors
        own, to_peer = inputs[me].contiguous(), inputs[1 - me].contiguous()
        return _then(alg.reduce_scatter_pair(target, own, to_peer, op, group, me=me), copy_back)
    if algo == "alltoall":  # sends one flat buffer
        flat = torch.cat([t.reshape(-1) for t in inputs])
        sizes = [t.numel() for t in inputs]
        pending = alg.reduce_scatter_alltoall(
            target, flat, op, group, ranks=ranks, me=me, sizes=sizes
        )
        return _then(pending, copy_back)
    inputs = [t.contiguous() for t in inputs]
    if algo == "ring":
        pending = alg.reduce_scatter_ring(
            target, inputs, op, group, ranks=ranks, me=me, tag=_ring_tag(ranks)
        )
    elif algo == "allreduce-slice":
        refused = (_key(member.backend, "all_reduce", output.dtype, op), "native") in _UNSUPPORTED
        wide = alg.upcast_dtype(output.dtype) if refused else output.dtype
        pending = alg.reduce_scatter_allreduce(target, inputs, op, group, me=me, comm_dtype=wide)
    else:
        pending = alg.reduce_scatter_direct(target, inputs, op, group, ranks=ranks, me=me)
    return _then(pending, copy_back)


def reduce_scatter(
    output: torch.Tensor,
    input_list: list[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> TrackedWork | None:
    """Reduce ``input_list[i]`` across ranks into rank i's ``output`` (sizes may differ per rank)."""
    if (member := _member(group, output)) is None:
        return None
    if len(input_list) != len(member.ranks):
        raise ValueError(
            f"reduce_scatter: input_list has {len(input_list)} entries, "
            f"group has {len(member.ranks)} ranks"
        )
    preferred = _prefer_fast(member, gather=False)
    if member.backend == "gloo" and not all(t.shape == output.shape for t in input_list):
        preferred = "alltoall"  # gloo's own cannot take uneven blocks
    if _prefer_shm(group, member, [output, *input_list], _nbytes(input_list)):
        preferred = "shm"

    def issue(algo: str) -> Any:
        if algo == "native":
            return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=True)
        return _scatter_algorithm(algo, output, input_list, op, group, member)

    return _run(
        "reduce_scatter",
        group,
        member,
        [output, *input_list],
        _nbytes(input_list),
        async_op,
        issue,
        preferred=preferred,
        redop=op,
    )


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> TrackedWork | None:
    """Reduce ``input`` (group size x ``output`` elements) across ranks; rank i keeps block i.

    Example:
        >>> shard = torch.empty(grad.numel() // world_size)
        >>> ds_comm.reduce_scatter_tensor(shard, grad)
    """
    if (member := _member(group, input)) is None:
        return None
    n = len(member.ranks)

    def issue(algo: str) -> Any:
        if algo == "native":
            return dist.reduce_scatter_tensor(output, input, op=op, group=group, async_op=True)
        if input.numel() != n * output.numel():
            raise ValueError(
                f"reduce_scatter_tensor: input must have {n} x {output.numel()} elements, "
                f"got {tuple(input.shape)}"
            )
        if algo == "shm":  # one buffer: no per-block views (see _shm.ShmGroup.reduce_scatter)
            staged, copy_back = _contiguous_outputs([output])
            state = _shm.shm_group(group, member.ranks, member.me)
            pending = state.reduce_scatter(
                staged[0], input.contiguous(), op, "reduce_scatter_tensor"
            )
            if pending is not None:
                return _then(pending, copy_back)
            algo = "alltoall"  # every rank alike: no segment could hold this message
        if algo == "alltoall" and output.is_contiguous():  # straight from the caller's buffer
            return alg.reduce_scatter_alltoall(
                output, input.contiguous(), op, group, ranks=member.ranks, me=member.me
            )
        blocks = list(input.contiguous().view(-1).split(output.numel()))
        return _scatter_algorithm(algo, output, blocks, op, group, member)

    tensors = [output, input]
    if _prefer_shm(group, member, tensors, input.nbytes):
        preferred = "shm"
    else:
        preferred = _prefer_fast(member, gather=False)
    return _run(
        "reduce_scatter_tensor",
        group,
        member,
        tensors,
        input.nbytes,
        async_op,
        issue,
        preferred=preferred,
        redop=op,
    )


# --- all-to-all and barrier ----------------------------------------------------------------------


def _splits(sizes: Sequence[int] | None, rows: int, n: int, what: str) -> list[int]:
    if sizes is None or len(sizes) == 0:
        if rows % n:
            raise ValueError(
                f"all_to_all_single: {what} has {rows} rows, not divisible by {n} ranks"
            )
        return [rows // n] * n
    if len(sizes) != n or sum(sizes) != rows:
        raise ValueError(
            f"all_to_all_single: {what} split sizes {list(sizes)} do not cover {rows} rows in {n} parts"
        )
    return list(sizes)


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int] | None = None,
    input_split_sizes: list[int] | None = None,
    group: Any = None,
    async_op: bool = False,
) -> TrackedWork | None:
    """Split ``input`` along dim 0 and send block i to rank i; ``output`` gets block from each rank.

    Split sizes count rows of dim 0 and may be uneven; ``None`` means equal blocks.
    """
    if (member := _member(group, input)) is None:
        return None
    ranks, me = member.ranks, member.me
    n = len(ranks)

    def issue(algo: str) -> Any:
        if algo == "native":
            return dist.all_to_all_single(
                output, input, output_split_sizes, input_split_sizes, group=group, async_op=True
            )
        source = input.contiguous()
        staged, copy_back = _contiguous_outputs([output])
        outs = staged[0].split(_splits(output_split_sizes, output.size(0), n, "output"))
        ins = source.split(_splits(input_split_sizes, input.size(0), n, "input"))
        return _then(alg.all_to_all_direct(outs, ins, group, ranks=ranks, me=me), copy_back)

    return _run("all_to_all_single", group, member, [output, input], input.nbytes, async_op, issue)


def barrier(
    group: Any = None, async_op: bool = False, device_ids: list[int] | None = None
) -> TrackedWork | None:
    """Block until every rank of the group has entered the barrier.

    ``device_ids`` (NCCL only, as in torch) names the GPU this rank synchronises on.
    """
    if _member(group) is None:
        return None
    return tracked(
        "barrier",
        group,
        [],
        msg_bytes=0,
        algo="native",
        async_op=async_op,
        run=lambda: dist.barrier(group=group, async_op=True, device_ids=device_ids),
    )
