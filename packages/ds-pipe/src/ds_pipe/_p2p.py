"""Moving activations and their gradients between neighbouring (virtual) stages over ds_comm.

[Note: negotiated metadata]
The receiver of an activation must allocate a buffer of the right shape and dtype before the
bytes arrive. The first transfer on each channel is preceded by a header (an int64 tensor:
whether the value is a tuple, the tensor count, then for each tensor its dtype code,
``requires_grad`` flag, rank and shape; its length goes first in one int64); both sides cache
it, and later micro-batches send only data. As in
DeepSpeed, shapes must then stay fixed within a run of the same mode (training and evaluation
negotiate separately); a changed shape is an error on the sender naming both shapes. Gradients
need no header: they have the shapes of the activations the receiver sent. Headers are built on
the device the transfers use (:attr:`PipeChannels.wire_device`) and read back with one
``tolist()``.

[Note: one ordered stream per pair of ranks]
NCCL matches point-to-point messages between two ranks strictly in posting order and ignores
tags; gloo matches by (peer, tag), in posting order within a tag. So correctness must not rest
on tags: for every ordered pair (sender, receiver), the receiver posts its receives in exactly
the order the sender posts its sends, and then any backend, tags or none, pairs each receive with
the right message. Three things make that true:

- The sender's order is known to the receiver. Every rank's schedule is a pure function of
  (schedule, micro-batches, stages, stage, chunks per stage), so the engine rebuilds its peers'
  schedules and lists, for each peer, the messages that peer sends this rank, in the peer's
  instruction order (``PipelineEngine._plan`` -> :meth:`PipeChannels.start_batch`): an
  activation for each ``SendActivation`` aimed at one of this rank's chunks, a gradient for each
  ``SendGrad``, and the batch's loss last (from the last stage, when the loss goes point to
  point). A header is part of the first activation of its channel, sent just before its data.
- Receives are only ever posted from the head of that list: a receive the schedule needs now
  (:meth:`PipeChannels._take`) first posts every message ahead of it from the same peer (those
  land in their own channels' queues for later), and the receives posted ahead (see [Note:
  receives posted ahead]) take the next entries, stopping at the first one that cannot be posted
  yet. Nothing is ever posted out of turn, so the posting order is the list's order.
- The sender's sends follow the same list: ``send_activation``/``send_grads``/``send_loss`` run in
  schedule order, each posting its header (if any) and then its tensors in one go.

Blocking inside ``_take`` is safe: the message it waits for comes after every message it posts
on the way, and the sender posts sends without waiting, so those were sent first. A header's
body has a length only known once the length arrived, so posting ahead stops at an un-negotiated
activation; ``_take`` receives the header at once (it is about to wait for later data anyway).
When nothing declared what a peer sends (the channels used on their own, as in tests), each
receive is posted when asked for, and the caller's receive order must match the sends.

On NCCL the posting order has a second constraint: torch runs all the point-to-point ops
between two ranks of a group on one stream, in posting order, and an NCCL receive (or a large
send) occupies that stream until its peer's matching op runs. A receive posted ahead of a send
to the same peer could then wait for a message that the peer only sends after receiving that
send: a deadlock no tag can fix. So without tags each direction has a group of its own
(``reverse_group``: messages to a lower rank): on a (group, pair) stream one rank only sends and
the other only receives, in the same order, and the kth send always meets the kth receive.
NCCL also creates a pair's communicator at the pair's first op, blocking both CPUs until both
arrive, so :meth:`PipeChannels.connect` opens every pair's streams at construction in one
global order (pairs sorted by rank: a rank only ever waits for a pair that comes earlier).

Tags are then only a safety net. On gloo (which honours them) each channel keeps its own tag, as
before; everywhere else (NCCL, or ``DS_PIPE_TAGLESS=1``, which the tests use to run every gloo
test with all tags equal) every message uses tag 0.

[Note: failing every stage]
A stage that raises mid-batch leaves its neighbours blocked in receives that will never be
satisfied. :meth:`PipeChannels.abort` makes this rank's pipeline group fail: it waits 1 ms for a
receive that can never arrive (from a peer whose connection is still open: one already closed
fails at once), and gloo answers that timeout by closing every connection of the group, so each
peer blocked on this rank gets "Connection closed by peer" at once, aborts in turn and passes
the failure on (the engine raises ``PipelineAbortedError`` there). With tags, that receive uses
a tag no message uses. Without tags, a receive from a peer matches the next message that peer
sends this rank, so the aborting rank keeps receiving the peer's declared messages in order
(each waited for 1 ms) and then one more: past the end of what the peer sends this batch,
nothing can match it (a peer cannot start the next batch before this rank's part of the loss
exchange). A message whose size is unknown (a gradient of an activation never sent) cannot have
been sent, so any buffer times out there too. The pipeline group is the engine's own (all
ranks), so the default group stays usable for the caller's error handling. The batch's final
phase begins with the loss exchange on this group, before any collective of another group (tied
weights, data parallelism), so ranks that finished their schedule fail too. On NCCL a receive
cannot time out this way: the failing rank raises and its peers fail at the process group's
timeout (or when the launcher stops the job).
"""

from __future__ import annotations

import datetime
import os
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

import ds_comm

__all__ = [
    "TAGLESS_ENV",
    "PipeChannels",
    "PipelineAbortedError",
    "TensorMeta",
    "as_tensor_tuple",
    "is_peer_failure",
    "resolve_tagless",
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
TAGLESS_ENV = "DS_PIPE_TAGLESS"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")

Key = tuple[str, int]  # ("act", chunk) | ("grad", chunk) | ("loss", source rank)


class PipelineAbortedError(RuntimeError):
    """Another rank of the pipeline failed mid-batch (see [Note: failing every stage])."""


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is gloo reporting a closed connection: a peer aborted or died."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "Connection closed by peer" in text or "Connection reset by peer" in text
    )


def _backend(group: Any) -> str:
    return str(dist.get_backend(group)).lower()


def resolve_tagless(group: Any, tagless: bool | None = None) -> bool:
    """Whether the pipeline on ``group`` sends every message with the same tag.

    ``tagless`` wins when given; else ``DS_PIPE_TAGLESS=1`` forces it; else only backends that
    match point-to-point messages by tag (plain gloo, MPI) keep one tag per channel (see [Note:
    one ordered stream per pair of ranks]).
    """
    if tagless is not None:
        return bool(tagless)
    raw = os.environ.get(TAGLESS_ENV, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value not in _FALSE:
        raise ValueError(
            f"{TAGLESS_ENV}={raw!r}: expected 1 (every pipeline message uses one tag) or 0/unset "
            "(tags where the backend honours them)"
        )
    backend = _backend(group)
    return backend not in ("gloo", "mpi")


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


_LOSS_META = TensorMeta((), torch.float32, False)


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


def _encode(is_tuple: bool, metas: Sequence[TensorMeta], device: torch.device) -> torch.Tensor:
    values = [int(is_tuple), len(metas)]
    for meta in metas:
        values += [_DTYPES.index(meta.dtype), int(meta.requires_grad), len(meta.shape)]
        values += list(meta.shape)
    return torch.tensor(values, dtype=torch.int64, device=device)


def _decode(header: torch.Tensor) -> tuple[bool, list[TensorMeta]]:
    values = header.tolist()  # the one read back to the host
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
# metadata is known, the receives the batch will still make from a peer are posted ahead, in the
# peer's send order (see [Note: one ordered stream per pair of ranks]), up to ``_LOOKAHEAD`` per
# channel the peer sends on, so data flows as soon as the neighbour sends it. Cost: up to
# ``_LOOKAHEAD`` receive buffers per channel beyond what the schedule holds. A gradient can only
# be posted once this rank sent the activation it belongs to in this batch, and the loss once
# this rank sent anything: the first forward, which every later stage waits for, starts without
# waiting for those posts.

# [Note: the per-micro-batch path]
# On a small stage the time between two layers' compute is mostly Python and process wake-ups,
# and a host running several stages per core pays for every microsecond of it (the stages share
# the cores). So what does not change between micro-batches is computed once: the engine runs a
# schedule flattened into ``(handler, instruction)`` pairs, built at the first batch of each
# mode, with the messages each peer sends; the channels cache each chunk's rank and each receive
# channel's source, tag and metadata; the text naming a stage in errors is only built when an
# error is raised.


class PipeChannels:
    """Sends and receives of one pipeline rank: activations to the next virtual stage, gradients
    to the previous one, with [Note: negotiated metadata], [Note: one ordered stream per pair of
    ranks] and [Note: failing every stage].

    Args:
        group: the process group the transfers use (all ranks of the topology).
        rank_of_chunk: global rank running virtual stage ``c`` (with this rank's data/model
            coordinates).
        device: the stage's device: received tensors are returned there.
        tagless: send every message with tag 0 (None: see :func:`resolve_tagless`).
        reverse_group: a second group over the same ranks for messages to lower ranks (see
            [Note: one ordered stream per pair of ranks]); None: ``group`` carries both ways.

    Attributes:
        tagless: whether every message uses the same tag.
        wire_device: where the tensors handed to ds_comm live: ``device``, except on gloo with
            an accelerator device, where gloo's send/recv take host tensors only (torch's gloo
            has no CUDA point-to-point), so transfers are staged through host memory.

    Sends are posted without waiting (see [Note: why the order is deadlock-free] in
    ``_schedule.py``); call :meth:`wait_sends` before reusing or dropping what was sent.
    """

    def __init__(
        self,
        group: Any,
        rank_of_chunk: Any,
        device: torch.device,
        tagless: bool | None = None,
        reverse_group: Any = None,
    ) -> None:
        self.group = group
        self.reverse_group = reverse_group if reverse_group is not None else group
        self._me = ds_comm.get_rank()
        self.rank_of_chunk = rank_of_chunk
        self.device = torch.device(device)
        self.tagless = resolve_tagless(group, tagless)
        backend = _backend(group)
        self._gloo = "gloo" in backend and "nccl" not in backend
        staged = self._gloo and self.device.type != "cpu"
        self.wire_device = torch.device("cpu") if staged else self.device
        self._metas: dict[tuple[str, int], tuple[bool, list[TensorMeta]]] = {}
        # posted sends by micro-batch key (None: released at the end of the batch)
        self._pending: dict[Any, list[tuple[Any, torch.Tensor]]] = {}
        self._mode = "train"
        # this batch: what each peer still sends (not yet posted), in its order; the receives
        # posted and not yet taken, per channel and per peer; the chunks that sent activations
        self._incoming: dict[int, deque[Key]] = {}
        self._posted: dict[Key, deque[tuple[list[Any], list[torch.Tensor]]]] = {}
        self._outstanding: dict[int, int] = {}
        self._limit: dict[int, int] = {}
        self._sent: set[int] = set()
        self._sent_any = False
        # Per-transfer work kept off the hot path (see [Note: the per-micro-batch path]): the
        # rank of each chunk and what each receive channel gets, by (mode, kind, chunk).
        self._ranks: dict[int, int] = {}
        self._recv_plans: dict[tuple[str, str, int], tuple[int, list[TensorMeta]]] = {}

    # --- the batch's receive order ---------------------------------------------------------------

    def start_batch(self, mode: str, incoming: Mapping[int, Sequence[Key]]) -> None:
        """Begin a batch in ``mode``: ``incoming[peer]`` lists the messages rank ``peer`` sends
        this rank, in its send order (``("act", c)``: virtual stage ``c``'s input, ``("grad",
        c)``: the gradient of ``c``'s output, ``("loss", peer)``: the batch's loss). Posts the
        first receives (see [Note: receives posted ahead])."""
        self._mode = mode
        self._incoming = {peer: deque(keys) for peer, keys in incoming.items() if keys}
        self._posted = {}
        self._outstanding = dict.fromkeys(self._incoming, 0)
        self._limit = {peer: _LOOKAHEAD * len(set(keys)) for peer, keys in self._incoming.items()}
        self._sent = set()
        self._sent_any = False
        for peer in self._incoming:
            self._post_ahead(peer)

    def _rank(self, chunk: int) -> int:
        """The global rank running virtual stage ``chunk`` (cached: asked on every transfer)."""
        rank = self._ranks.get(chunk)
        if rank is None:
            rank = self._ranks[chunk] = self.rank_of_chunk(chunk)
        return rank

    def _source(self, key: Key) -> int:
        kind, value = key
        if kind == "act":
            return self._rank(value - 1)
        if kind == "grad":
            return self._rank(value + 1)
        return value  # the loss: its source rank

    def _group_to(self, dst: int) -> Any:
        """The group carrying messages from this rank to ``dst``."""
        return self.group if dst > self._me else self.reverse_group

    def _group_from(self, src: int) -> Any:
        """The group carrying messages from ``src`` to this rank."""
        return self.group if src < self._me else self.reverse_group

    def connect(self, peers: Sequence[int]) -> None:
        """Open the streams to and from each of ``peers`` now, every rank together, in one
        global order (see [Note: one ordered stream per pair of ranks]); one tiny message each
        way. Only needed where a backend connects a pair at its first op (NCCL)."""
        for peer in sorted(set(peers) - {self._me}):
            outgoing = torch.ones(1, device=self.wire_device)
            incoming = torch.zeros(1, device=self.wire_device)
            if self._me < peer:  # both sides post the pair's two ops in the same order
                sent = ds_comm.isend(outgoing, peer, group=self._group_to(peer))
                got = ds_comm.irecv(incoming, peer, group=self._group_from(peer))
            else:
                got = ds_comm.irecv(incoming, peer, group=self._group_from(peer))
                sent = ds_comm.isend(outgoing, peer, group=self._group_to(peer))
            sent.wait()
            got.wait()

    def _tag(self, key: Key) -> int:
        if self.tagless:
            return 0
        kind, value = key
        if kind == "loss":
            return _LOSS_TAG
        return _TAG_BASE + 2 * value + (0 if kind == "act" else 1)

    def _plan(self, key: Key, block: bool) -> tuple[int, list[TensorMeta]] | None:
        """Tag and metadata of a receive on ``key`` now; None: it cannot be posted yet (only
        when not ``block``, see [Note: receives posted ahead]). With ``block`` an un-negotiated
        activation's header is received first."""
        kind, value = key
        if not block and (
            (kind == "grad" and value not in self._sent) or (kind == "loss" and not self._sent_any)
        ):
            return None
        plan = self._recv_plans.get((self._mode, kind, value))
        if plan is not None:
            return plan
        if kind == "act":
            cached = self._metas.get((self._mode, value - 1))
            if cached is None:
                if not block:
                    return None
                cached = self._recv_header(value)
            metas = cached[1]
        elif kind == "grad":
            cached = self._metas.get(("train", value))  # the gradients of what this chunk sent
            if cached is None:
                raise RuntimeError(
                    f"pipeline protocol: a gradient of virtual stage {value}'s output is "
                    "received before that output was sent"
                )
            metas = [m for m in cached[1] if m.requires_grad]
        else:
            metas = [_LOSS_META]
        plan = self._recv_plans[(self._mode, kind, value)] = (self._tag(key), metas)
        return plan

    def _recv_header(self, chunk: int) -> tuple[bool, list[TensorMeta]]:
        """Receive (blocking) the header of virtual stage ``chunk``'s input."""
        src, tag = self._rank(chunk - 1), self._tag(("act", chunk))
        length = torch.zeros(1, dtype=torch.int64, device=self.wire_device)
        group = self._group_from(src)
        ds_comm.irecv(length, src, group=group, tag=tag).wait()
        header = torch.zeros(int(length.item()), dtype=torch.int64, device=self.wire_device)
        ds_comm.irecv(header, src, group=group, tag=tag).wait()
        cached = self._metas[(self._mode, chunk - 1)] = _decode(header)
        return cached

    def _post(self, peer: int, key: Key, block: bool) -> bool:
        """Post the receive of the next message ``key`` from ``peer``; False: not yet."""
        plan = self._plan(key, block)
        if plan is None:
            return False
        tag, metas = plan
        device = self.wire_device
        buffers = [torch.empty(m.shape, dtype=m.dtype, device=device) for m in metas]
        group = self._group_from(peer)
        works = [ds_comm.irecv(b, peer, group=group, tag=tag) for b in buffers]
        posted = self._posted.get(key)
        if posted is None:
            posted = self._posted[key] = deque()
        posted.append((works, buffers))
        self._outstanding[peer] = self._outstanding.get(peer, 0) + 1
        return True

    def _post_ahead(self, peer: int) -> None:
        """Post the next receives from ``peer``, in its send order, while they can be."""
        incoming = self._incoming.get(peer)
        limit = self._limit.get(peer, 0)
        while incoming and self._outstanding[peer] < limit:
            if not self._post(peer, incoming[0], block=False):
                return
            incoming.popleft()

    def _take(self, key: Key) -> list[torch.Tensor]:
        """The next message of channel ``key``: posted already, or posted now after every
        message its sender sends first (see [Note: one ordered stream per pair of ranks])."""
        peer = self._source(key)
        posted = self._posted.get(key)
        if not posted:
            incoming = self._incoming.get(peer)
            if incoming:
                while True:
                    if not incoming:
                        raise RuntimeError(
                            f"pipeline protocol: rank {peer} sends this rank no {key} in this "
                            "batch, but the schedule receives one"
                        )
                    head = incoming.popleft()
                    self._post(peer, head, block=True)
                    if head == key:
                        break
            else:  # nothing declared: the caller orders its receives as the peer its sends
                self._post(peer, key, block=True)
            posted = self._posted[key]
        works, buffers = posted.popleft()
        self._outstanding[peer] -= 1
        for work in works:
            work.wait()
        self._post_ahead(peer)
        if self.wire_device != self.device:
            return [b.to(self.device, non_blocking=True) for b in buffers]
        return buffers

    # --- sends -----------------------------------------------------------------------------------

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int, key: Any = None) -> None:
        tensor = tensor.detach()
        if tensor.device != self.wire_device:
            tensor = tensor.to(self.wire_device)
        tensor = tensor.contiguous()
        work = ds_comm.isend(tensor, dst, group=self._group_to(dst), tag=tag)
        self._pending.setdefault(key, []).append((work, tensor))

    def _sent_on(self, chunk: int | None) -> None:
        """Bookkeeping after a send: gradients of ``chunk`` and the loss may now be posted."""
        first = not self._sent_any
        self._sent_any = True
        if chunk is not None:
            self._sent.add(chunk)
        if first:
            for peer in self._incoming:
                self._post_ahead(peer)
        elif chunk is not None:
            self._post_ahead(self._rank(chunk + 1))

    def release(self, chunk: int, micro_batch: int) -> None:
        """Drop the activation sends of ``micro_batch`` from virtual stage ``chunk``: call it once
        their gradient came back, which proves they were received (so the wait is immediate)."""
        for work, _ in self._pending.pop(("act", chunk, micro_batch), ()):
            work.wait()

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
        dst, tag, key = self._rank(chunk + 1), self._tag(("act", chunk + 1)), (mode, chunk)
        if torch.is_tensor(value):  # the common case, checked without building a tuple
            outputs: tuple[torch.Tensor, ...] = (value,)
        else:
            outputs = as_tensor_tuple(value, where if isinstance(where, str) else where())
        cached = self._metas.get(key)
        if cached is not None and _matches(cached, value, outputs):
            pass  # the usual case: negotiated, and the same shapes again
        elif cached is None:
            metas = (isinstance(value, (tuple, list)), [meta_of(t) for t in outputs])
            header = _encode(*metas, device=self.wire_device)
            length = torch.tensor([header.numel()], dtype=torch.int64, device=self.wire_device)
            self._isend(length, dst, tag)
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
        send_key = None if micro_batch is None else ("act", chunk, micro_batch)
        for t in outputs:
            self._isend(t, dst, tag, send_key)
        # its gradient may come back from now on
        self._sent_on(chunk if mode == "train" else None)

    def recv_activation(self, chunk: int, mode: str) -> Any:
        """Receive virtual stage ``chunk``'s input from ``chunk - 1``: fresh leaf tensors
        (``requires_grad`` as the sender's), a tuple when the sender's output was one."""
        self._mode = mode
        tensors = self._take(("act", chunk))
        is_tuple, metas = self._metas[(mode, chunk - 1)]
        out = [
            t.requires_grad_(meta.requires_grad and mode == "train")
            for t, meta in zip(tensors, metas)
        ]
        return tuple(out) if is_tuple else out[0]

    def send_grads(self, inputs: Sequence[torch.Tensor], chunk: int) -> None:
        """Send the gradients of ``inputs`` (those that require grad; zeros where unused) of
        virtual stage ``chunk`` back to ``chunk - 1``."""
        dst, tag = self._rank(chunk - 1), self._tag(("grad", chunk - 1))
        for t in inputs:
            if t.requires_grad:
                self._isend(t.grad if t.grad is not None else torch.zeros_like(t), dst, tag)
        self._sent_on(None)

    def recv_grads(self, outputs: Sequence[torch.Tensor], chunk: int) -> list[torch.Tensor | None]:
        """Receive the gradients of virtual stage ``chunk``'s ``outputs`` from ``chunk + 1``:
        one per output that requires grad, None for the others."""
        received = iter(self._take(("grad", chunk)))
        return [next(received) if t.requires_grad else None for t in outputs]

    def take_loss(self, src: int) -> torch.Tensor:
        """Receive the batch's loss (a 0-dim fp32 tensor) from the last stage's rank ``src``."""
        return self._take(("loss", src))[0]

    def send_loss(self, loss: torch.Tensor, dsts: Sequence[int]) -> None:
        """Send the batch's loss (a 0-dim fp32 tensor) to the ranks ``dsts``."""
        tag = self._tag(("loss", -1))
        for dst in dsts:
            self._isend(loss, dst, tag)

    def wait_sends(self) -> None:
        """Wait until every posted send has been handed over, then drop the references."""
        pending, self._pending = self._pending, {}
        for sends in pending.values():
            for work, _ in sends:
                work.wait()

    # --- failure ---------------------------------------------------------------------------------

    def abort(self) -> None:
        """Fail the pipeline group(s) on every rank (see [Note: failing every stage])."""
        incoming = self._incoming
        self._pending.clear()
        self._posted.clear()
        self._incoming = {}
        world = ds_comm.get_world_size(self.group)
        if world < 2 or not self._gloo:
            return
        groups = (
            [self.group] if self.reverse_group is self.group else [self.group, self.reverse_group]
        )
        for group in groups:
            self._fail(group, incoming)

    def _fail(self, group: Any, incoming: Mapping[int, Sequence[Key]]) -> None:
        """Make one receive on ``group`` time out, which closes its connections."""
        # A receive from a peer whose connection is already closed fails at once without
        # closing the others, so try every peer until one times out.
        for peer in dist.get_process_group_ranks(group):
            if peer == self._me:
                continue
            # what the peer still sends this rank on this group
            declared = incoming.get(peer, ()) if self._group_from(peer) is group else ()
            try:
                for work in self._abort_receives(peer, group, declared):
                    work.wait(datetime.timedelta(milliseconds=1))
            except RuntimeError as exc:
                if "timed out" in str(exc).lower():
                    return  # gloo closed every connection of the group

    def _abort_receives(self, peer: int, group: Any, incoming: Sequence[Key]) -> Iterator[Any]:
        """Raw (untracked: they are meant to time out) receives from ``peer`` on ``group`` that
        end in one nothing can match; the caller waits for each in turn (see [Note: failing
        every stage])."""
        wire = self.wire_device

        def recv(tensor: torch.Tensor, tag: int = 0) -> Any:  # bytes, as ds_comm sends them
            return dist.irecv(tensor.reshape(-1).view(torch.uint8), src=peer, group=group, tag=tag)

        if not self.tagless:
            yield recv(torch.zeros(1, device=wire), _ABORT_TAG)
            return
        for key in incoming:  # after those posted already, in the peer's send order
            kind, value = key
            metas: list[TensorMeta] = [_LOSS_META]
            if kind == "act":
                cached = self._metas.get((self._mode, value - 1))
                if cached is None:  # its header comes first
                    length = torch.zeros(1, dtype=torch.int64, device=wire)
                    yield recv(length)
                    header = torch.zeros(int(length.item()), dtype=torch.int64, device=wire)
                    yield recv(header)
                    cached = self._metas[(self._mode, value - 1)] = _decode(header)
                metas = cached[1]
            elif kind == "grad":
                cached = self._metas.get(("train", value))
                # unknown: the activation was never sent, so neither is its gradient
                metas = [m for m in cached[1] if m.requires_grad] if cached else [_LOSS_META]
            for m in metas:
                yield recv(torch.empty(m.shape, dtype=m.dtype, device=wire))
        yield recv(torch.zeros(1, device=wire))


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
