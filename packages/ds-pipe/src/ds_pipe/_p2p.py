"""Moving activations and their gradients between neighbouring (virtual) stages over ds_comm.

[Note: negotiated metadata]
The receiver of an activation must allocate a buffer of the right shape and dtype before the
bytes arrive. The first transfer on each channel is preceded by a header (an int64 tensor:
whether the value is a tuple, the tensor count, then for each tensor its dtype code,
``requires_grad`` flag, rank and shape; its length goes first in one int64); both sides cache
it, and later micro-batches send only data. As in
DeepSpeed, shapes must then stay fixed within a run of the same mode (training and evaluation
negotiate separately); a changed shape is an error on the sender naming both shapes. Gradients
need no header: they have the shapes of the activations the receiver sent.

[Note: failing every stage]
A stage that raises mid-batch leaves its neighbours blocked in receives that will never be
satisfied. :meth:`PipeChannels.abort` makes this rank's pipeline group fail: it waits 1 ms for a
receive that can never arrive (from a peer whose connection is still open: one already closed
fails at once), and gloo answers that timeout by closing every connection of the group, so each
peer blocked on this rank gets "Connection closed by peer" at once, aborts in turn and passes
the failure on (the engine raises ``PipelineAbortedError`` there). The pipeline group is the
engine's own (all ranks), so the default group stays usable for the caller's error handling.
The batch's final phase begins with the loss exchange on this group, before any collective of
another group (tied weights, data parallelism), so ranks that finished their schedule fail too.
"""

from __future__ import annotations

import datetime
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

import ds_comm

__all__ = [
    "PipeChannels",
    "PipelineAbortedError",
    "TensorMeta",
    "as_tensor_tuple",
    "is_peer_failure",
]

_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
_TAG_BASE = 1 << 16  # keeps pipeline tags apart from any small tags a caller uses
_ABORT_TAG = (1 << 30) - 1
_LOSS_TAG = (1 << 30) - 2
_LOOKAHEAD = 2  # receives posted ahead per channel, see [Note: receives posted ahead]


class PipelineAbortedError(RuntimeError):
    """Another rank of the pipeline failed mid-batch (see [Note: failing every stage])."""


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is gloo reporting a closed connection: a peer aborted or died."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "Connection closed by peer" in text or "Connection reset by peer" in text
    )


class TensorMeta(tuple):
    """``(shape, dtype, requires_grad)`` of one transferred tensor."""

    __slots__ = ()

    def __new__(cls, shape: Sequence[int], dtype: torch.dtype, requires_grad: bool) -> TensorMeta:
        return super().__new__(cls, (tuple(int(d) for d in shape), dtype, bool(requires_grad)))

    @property
    def shape(self) -> tuple[int, ...]:
        return self[0]

    @property
    def dtype(self) -> torch.dtype:
        return self[1]

    @property
    def requires_grad(self) -> bool:
        return self[2]


def as_tensor_tuple(value: Any, where: str) -> tuple[torch.Tensor, ...]:
    """``value`` as a tuple of tensors; anything else is a TypeError naming ``where``."""
    items = tuple(value) if isinstance(value, (tuple, list)) else (value,)
    for i, item in enumerate(items):
        if not torch.is_tensor(item):
            what = f"item {i} of the output" if isinstance(value, (tuple, list)) else "the output"
            raise TypeError(
                f"{where}: {what} is a {type(item).__name__}; a pipeline stage can only pass "
                "tensors or tuples of tensors to the next stage (turn other values into tensors, "
                "or compute them inside the stage that needs them)"
            )
    return items


def _encode(is_tuple: bool, metas: Sequence[TensorMeta]) -> torch.Tensor:
    values = [int(is_tuple), len(metas)]
    for meta in metas:
        values += [_DTYPES.index(meta.dtype), int(meta.requires_grad), len(meta.shape)]
        values += list(meta.shape)
    return torch.tensor(values, dtype=torch.int64)


def _decode(header: torch.Tensor) -> tuple[bool, list[TensorMeta]]:
    values = header.tolist()
    count, pos, metas = values[1], 2, []
    for _ in range(count):
        code, requires_grad, ndim = values[pos : pos + 3]
        shape = values[pos + 3 : pos + 3 + ndim]
        pos += 3 + ndim
        metas.append(TensorMeta(shape, _DTYPES[code], bool(requires_grad)))
    return bool(values[0]), metas


def meta_of(tensor: torch.Tensor) -> TensorMeta:
    """The transfer metadata of ``tensor``."""
    if tensor.dtype not in _DTYPES:
        raise TypeError(f"dtype {tensor.dtype} cannot be sent between stages")
    return TensorMeta(tensor.shape, tensor.dtype, tensor.requires_grad)


# [Note: receives posted ahead]
# A gloo receive posted after its data was sent costs another round trip (and with ~1 ms
# loopback latency on a busy host that is as long as a small stage's compute). Once a channel's
# metadata is known, the receives the batch will still make on it are posted ahead, up to
# ``_LOOKAHEAD`` at a time, so data flows as soon as the neighbour sends it. The engine says how
# many receives each channel takes in the batch (:meth:`PipeChannels.start_batch`); gloo matches
# receives of one (peer, tag) in posting order, so posting ahead keeps the order. Cost: up to
# ``_LOOKAHEAD`` receive buffers per channel beyond what the schedule holds. A gradient channel
# is first posted by the rank's first activation send on it (no gradient can come earlier), not
# at the start of the batch: the first forward, which every later stage waits for, starts
# without waiting for those posts.

# [Note: the per-micro-batch path]
# On a small stage the time between two layers' compute is mostly Python and process wake-ups,
# and a host running several stages per core pays for every microsecond of it (the stages share
# the cores). So what does not change between micro-batches is computed once: the engine runs a
# schedule flattened into ``(handler, instruction)`` pairs, built at the first batch of each
# mode; the channels cache each chunk's rank and each receive channel's source, tag and
# metadata; the text naming a stage in errors is only built when an error is raised.


class PipeChannels:
    """Sends and receives of one pipeline rank: activations to the next virtual stage, gradients
    to the previous one, with [Note: negotiated metadata] and [Note: failing every stage].

    Args:
        group: the process group the transfers use (all ranks of the topology).
        rank_of_chunk: global rank running virtual stage ``c`` (with this rank's data/model
            coordinates).
        device: where received tensors are allocated.

    Sends are posted without waiting (see [Note: why the order is deadlock-free] in
    ``_schedule.py``); call :meth:`wait_sends` before reusing or dropping what was sent.
    """

    def __init__(self, group: Any, rank_of_chunk: Any, device: torch.device) -> None:
        self.group = group
        self.rank_of_chunk = rank_of_chunk
        self.device = device
        self._metas: dict[tuple[str, int], tuple[bool, list[TensorMeta]]] = {}
        # posted sends by micro-batch key (None: released at the end of the batch)
        self._pending: dict[Any, list[tuple[Any, torch.Tensor]]] = {}
        self._mode = "train"
        self._expected: dict[tuple[str, int], int] = {}
        self._posted: dict[tuple[str, int], deque[tuple[list[Any], list[torch.Tensor]]]] = {}
        self._loss: tuple[Any, torch.Tensor] | None = None
        # Per-transfer work kept off the hot path (see [Note: the per-micro-batch path]): the
        # rank of each chunk and what each receive channel gets, by (mode, kind, chunk).
        self._ranks: dict[int, int] = {}
        self._recv_plans: dict[tuple[str, str, int], tuple[int, int, list[TensorMeta]]] = {}

    def start_batch(self, mode: str, expected: Mapping[tuple[str, int], int]) -> None:
        """Begin a batch in ``mode`` that receives ``expected[(kind, chunk)]`` times on each
        channel (``kind`` ``'act'`` or ``'grad'``); posts the first activation receives (see
        [Note: receives posted ahead])."""
        self._mode = mode
        self._expected = dict(expected)
        self._posted = {}
        for key in self._expected:
            # A gradient cannot come before this rank sent the activation it belongs to: its
            # receives are posted by the first send (not here, ahead of the first forward).
            if key[0] == "act":
                self._post_ahead(key)

    def _rank(self, chunk: int) -> int:
        """The global rank running virtual stage ``chunk`` (cached: asked on every transfer)."""
        rank = self._ranks.get(chunk)
        if rank is None:
            rank = self._ranks[chunk] = self.rank_of_chunk(chunk)
        return rank

    def _channel(self, key: tuple[str, int]) -> tuple[int, int, list[TensorMeta]] | None:
        """Source, tag and the metadata of what a receive on channel ``key`` gets (None: not
        negotiated yet)."""
        plan = self._recv_plans.get((self._mode, *key))
        if plan is not None:
            return plan
        kind, chunk = key
        if kind == "act":
            cached = self._metas.get((self._mode, chunk - 1))
            if cached is None:
                return None
            plan = (self._rank(chunk - 1), self._tag("act", chunk), cached[1])
        else:
            cached = self._metas.get(("train", chunk))  # the gradients of what this chunk sent
            if cached is None:
                return None
            metas = [m for m in cached[1] if m.requires_grad]
            plan = (self._rank(chunk + 1), self._tag("grad", chunk), metas)
        self._recv_plans[(self._mode, *key)] = plan
        return plan

    def _post_ahead(self, key: tuple[str, int]) -> None:
        posted = self._posted.setdefault(key, deque())
        while len(posted) < _LOOKAHEAD and self._expected.get(key, 0) > 0:
            channel = self._channel(key)
            if channel is None:
                return
            src, tag, metas = channel
            buffers = [torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas]
            works = [ds_comm.irecv(b, src, group=self.group, tag=tag) for b in buffers]
            posted.append((works, buffers))
            self._expected[key] -= 1

    def _take(self, key: tuple[str, int]) -> list[torch.Tensor]:
        """The next receive of channel ``key``: a posted one, or one made now."""
        posted = self._posted.get(key)
        if posted:
            works, buffers = posted.popleft()
            for work in works:
                work.wait()
        else:
            channel = self._channel(key)
            assert channel is not None, key
            src, tag, metas = channel
            buffers = [
                self._recv(torch.empty(m.shape, dtype=m.dtype, device=self.device), src, tag)
                for m in metas
            ]
            self._expected[key] = self._expected.get(key, 1) - 1
        self._post_ahead(key)
        return buffers

    @staticmethod
    def _tag(kind: str, chunk: int) -> int:
        return _TAG_BASE + 2 * chunk + (0 if kind == "act" else 1)

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int, key: Any = None) -> None:
        tensor = tensor.detach().contiguous()
        work = ds_comm.isend(tensor, dst, group=self.group, tag=tag)
        self._pending.setdefault(key, []).append((work, tensor))

    def release(self, chunk: int, micro_batch: int) -> None:
        """Drop the activation sends of ``micro_batch`` from virtual stage ``chunk``: call it once
        their gradient came back, which proves they were received (so the wait is immediate)."""
        for work, _ in self._pending.pop(("act", chunk, micro_batch), ()):
            work.wait()

    def _recv(self, tensor: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        ds_comm.irecv(tensor, src, group=self.group, tag=tag).wait()
        return tensor

    def forget(self, mode: str) -> None:
        """Drop the negotiated metadata of ``mode`` (every rank together): renegotiate."""
        self._metas = {k: v for k, v in self._metas.items() if k[0] != mode}
        self._recv_plans.clear()

    def send_activation(
        self,
        value: Any,
        chunk: int,
        mode: str,
        where: str | Callable[[], str],
        micro_batch: int | None = None,
    ) -> None:
        """Send ``value`` (a tensor or a tuple of tensors), the output of virtual stage
        ``chunk``, to ``chunk + 1`` (with a header the first time). ``where`` names the output
        in errors (a callable is only called then). With ``micro_batch`` the sends can be
        dropped early by :meth:`release`."""
        dst, tag, key = self._rank(chunk + 1), self._tag("act", chunk + 1), (mode, chunk)
        if torch.is_tensor(value):  # the common case, checked without building a tuple
            outputs: tuple[torch.Tensor, ...] = (value,)
        else:
            outputs = as_tensor_tuple(value, where if isinstance(where, str) else where())
        cached = self._metas.get(key)
        if cached is not None and _matches(cached, value, outputs):
            pass  # the usual case: negotiated, and the same shapes again
        elif cached is None:
            metas = (isinstance(value, (tuple, list)), [meta_of(t) for t in outputs])
            header = _encode(*metas)
            self._isend(torch.tensor([header.numel()], dtype=torch.int64), dst, tag)
            self._isend(header, dst, tag)
            self._metas[key] = metas
        else:
            metas = (isinstance(value, (tuple, list)), [meta_of(t) for t in outputs])
            raise ValueError(
                f"{where if isinstance(where, str) else where()}: the output changed from "
                f"{_describe(cached[1])} to {_describe(metas[1])} "
                "after the first micro-batch; pipeline activations must keep their shapes, dtypes "
                "and requires_grad (pad inputs to a fixed shape)"
            )
        key = None if micro_batch is None else ("act", chunk, micro_batch)
        for t in outputs:
            self._isend(t, dst, tag, key)
        if mode == "train":  # its gradient may come back from now on
            self._post_ahead(("grad", chunk))

    def recv_activation(self, chunk: int, mode: str) -> Any:
        """Receive virtual stage ``chunk``'s input from ``chunk - 1``: fresh leaf tensors
        (``requires_grad`` as the sender's), a tuple when the sender's output was one."""
        src, tag, key = self._rank(chunk - 1), self._tag("act", chunk), (mode, chunk - 1)
        self._mode = mode
        cached = self._metas.get(key)
        if cached is None:
            length = self._recv(torch.zeros(1, dtype=torch.int64), src, tag)
            header = self._recv(torch.zeros(int(length.item()), dtype=torch.int64), src, tag)
            cached = self._metas[key] = _decode(header)
        is_tuple, metas = cached
        out = [
            t.requires_grad_(meta.requires_grad and mode == "train")
            for t, meta in zip(self._take(("act", chunk)), metas)
        ]
        return tuple(out) if is_tuple else out[0]

    def send_grads(self, inputs: Sequence[torch.Tensor], chunk: int) -> None:
        """Send the gradients of ``inputs`` (those that require grad; zeros where unused) of
        virtual stage ``chunk`` back to ``chunk - 1``."""
        dst, tag = self._rank(chunk - 1), self._tag("grad", chunk - 1)
        for t in inputs:
            if t.requires_grad:
                self._isend(t.grad if t.grad is not None else torch.zeros_like(t), dst, tag)

    def recv_grads(self, outputs: Sequence[torch.Tensor], chunk: int) -> list[torch.Tensor | None]:
        """Receive the gradients of virtual stage ``chunk``'s ``outputs`` from ``chunk + 1``:
        one per output that requires grad, None for the others."""
        received = iter(self._take(("grad", chunk)))
        return [next(received) if t.requires_grad else None for t in outputs]

    def post_loss_recv(self, src: int) -> None:
        """Post the receive of the batch's loss from the last stage's rank ``src``."""
        buffer = torch.zeros((), dtype=torch.float32, device=self.device)
        self._loss = (ds_comm.irecv(buffer, src, group=self.group, tag=_LOSS_TAG), buffer)

    def take_loss(self) -> torch.Tensor:
        """Wait for the loss posted by :meth:`post_loss_recv`."""
        work, buffer = self._loss
        work.wait()
        return buffer

    def send_loss(self, loss: torch.Tensor, dsts: Sequence[int]) -> None:
        """Send the batch's loss (a 0-dim fp32 tensor) to the ranks ``dsts``."""
        for dst in dsts:
            self._isend(loss, dst, _LOSS_TAG)

    def wait_sends(self) -> None:
        """Wait until every posted send has been handed over, then drop the references."""
        pending, self._pending = self._pending, {}
        for sends in pending.values():
            for work, _ in sends:
                work.wait()

    def abort(self) -> None:
        """Fail the pipeline group on every rank (see [Note: failing every stage])."""
        self._pending.clear()
        self._posted.clear()
        self._loss = None
        world = ds_comm.get_world_size(self.group)
        if world < 2:
            return
        me = ds_comm.get_rank()
        # A receive from a peer whose connection is already closed fails at once without
        # closing the others, so try every peer until one times out.
        for peer in dist.get_process_group_ranks(self.group):
            if peer == me:
                continue
            try:  # a raw torch op (not tracked): this receive is meant to time out
                work = dist.irecv(torch.zeros(1), src=peer, group=self.group, tag=_ABORT_TAG)
                work.wait(datetime.timedelta(milliseconds=1))
            except RuntimeError as exc:
                if "timed out" in str(exc).lower():
                    return  # gloo closed every connection of the group


def _matches(cached: tuple[bool, list[TensorMeta]], value: Any, outputs: Sequence[Any]) -> bool:
    """Whether ``outputs`` (``value`` as a tuple) have the negotiated metadata ``cached``."""
    is_tuple, metas = cached
    return (
        is_tuple == isinstance(value, (tuple, list))
        and len(metas) == len(outputs)
        and all(
            t.shape == m.shape and t.dtype == m.dtype and t.requires_grad == m.requires_grad
            for t, m in zip(outputs, metas)
        )
    )


def _describe(metas: Sequence[TensorMeta]) -> str:
    return "(" + ", ".join(f"{m.dtype}{list(m.shape)}" for m in metas) + ")"
