"""Point-to-point ops: ``send``/``recv``/``isend``/``irecv`` and ``batch_isend_irecv``, each tracked.

``dst``/``src``/``peer`` are global ranks, as in torch. Transfers move the tensor's bytes: see
[Note: transfers move bytes] in ``_algorithms.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ds_comm import _algorithms as alg
from ds_comm._instrument import TrackedWork, begin_one, end, failed, tracked

__all__ = ["P2POp", "batch_isend_irecv", "irecv", "isend", "recv", "send"]


def _p2p(
    op: str, issue: Callable[..., Any], tensor: torch.Tensor, peer: int | None, group: Any, tag: int
) -> TrackedWork:
    """Issue one tracked transfer: ``issue(wire, peer, group, tag)`` is ``dist.isend``/``irecv``.

    The tracked path inlined (no closure per call; see [Note: cheap tracking] in
    ``_instrument.py``): a pipeline stage makes thousands of these calls a second.
    """
    rec = begin_one(op, group, tensor, "native", op != "send")  # send waits at once
    try:
        work = issue(alg.wire(tensor), peer, group, tag)
    except BaseException as exc:
        failed(rec, exc)
        raise
    return TrackedWork(work, rec)


def send(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
    """Send contiguous ``tensor`` to global rank ``dst`` (blocks until it is handed over)."""
    _p2p("send", dist.isend, tensor, dst, group, tag).wait()


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0) -> int:
    """Receive into contiguous ``tensor`` from global rank ``src`` (any rank if None).

    Returns:
        The global rank the data came from.
    """
    rec = begin_one("recv", group, tensor, "native", False)
    try:
        sender = dist.recv(alg.wire(tensor), src, group, tag)
    except BaseException as exc:
        failed(rec, exc)
        raise
    end(rec)
    return sender


def isend(tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> TrackedWork:
    """Start sending ``tensor`` to global rank ``dst``; ``wait()`` the handle before reusing it."""
    return _p2p("isend", dist.isend, tensor, dst, group, tag)


def irecv(
    tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0
) -> TrackedWork:
    """Start receiving into ``tensor`` from global rank ``src``; ``wait()`` before reading it."""
    return _p2p("irecv", dist.irecv, tensor, src, group, tag)


class P2POp:
    """One transfer of :func:`batch_isend_irecv`, as ``torch.distributed.P2POp``.

    ``op`` is ``isend`` or ``irecv`` (ds-comm's or torch's); ``peer`` is a global rank.

    Example:
        >>> ops = [P2POp(isend, out, next_rank), P2POp(irecv, inp, prev_rank)]
        >>> for work in batch_isend_irecv(ops):
        ...     work.wait()
    """

    __slots__ = ("group", "op", "peer", "tag", "tensor")

    def __init__(
        self,
        op: Callable[..., Any],
        tensor: torch.Tensor,
        peer: int,
        group: Any = None,
        tag: int = 0,
    ) -> None:
        if op not in (isend, irecv, dist.isend, dist.irecv):
            raise ValueError("P2POp: op must be isend or irecv (ds_comm's or torch.distributed's)")
        self.op = op
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = tag

    @property
    def is_send(self) -> bool:
        return self.op in (isend, dist.isend)


class _BatchMember:
    """One handle of a :func:`batch_isend_irecv` result; the last one waited completes the record."""

    def __init__(self, work: alg.WaitOnce, batch: TrackedWork) -> None:
        self._work = work
        self._batch = batch

    def wait(self, timeout: Any = None) -> bool:
        self._work.wait(timeout)
        if self._batch.is_completed():
            self._batch.wait()  # every transfer is done: this only closes the call's record
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def get_future(self) -> Any:
        return self._work.get_future()


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[_BatchMember]:
    """Post a list of sends and receives at once (one tracked call); returns their handles."""
    if not p2p_op_list:
        raise ValueError("batch_isend_irecv: expected a non-empty list of P2POp")
    torch_ops = [
        dist.P2POp(
            dist.isend if p.is_send else dist.irecv, alg.wire(p.tensor), p.peer, p.group, p.tag
        )
        for p in p2p_op_list
    ]
    works: list[alg.WaitOnce] = []

    def run() -> alg.Pending:
        works.extend(alg.WaitOnce(work) for work in dist.batch_isend_irecv(torch_ops))
        return alg.Pending(works)

    tensors = [p.tensor for p in p2p_op_list]
    batch = tracked(
        "batch_isend_irecv", p2p_op_list[0].group, tensors, msg_bytes=sum(t.nbytes for t in tensors),
        algo="native", async_op=True, run=run,
    )  # fmt: skip
    assert batch is not None
    return [_BatchMember(work, batch) for work in works]
