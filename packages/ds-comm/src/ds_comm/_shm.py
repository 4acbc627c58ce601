"""All-gather and reduce-scatter through shared memory for groups whose ranks all run on one host
(gloo, CPU).

[Note: shared-memory all-gather]
Over TCP loopback both torch's gloo all-gather and ds-comm's all-to-all pay for every byte
crossing a socket (copies into and out of the kernel, wake-ups per chunk). Ranks on one host can
instead share one memory segment, as DeepSpeed's CPU backend does for its shm all-reduce: each
rank copies its block into its slot, publishes a sequence number, waits until every rank's
sequence number reached this op, copies the gathered blocks out (its own straight from its
input while the peers arrive, each peer's as soon as it has arrived; slots are packed for the
op's block size) and acknowledges. A rank writes op k's block only after every
rank has acknowledged op k-1, so no slot is overwritten before everyone has read it.

Per group, a :class:`ShmGroup` (created lazily, weakly keyed by the process group) agrees once,
through a collective, on whether all ranks share a host and on a name. The segment is created at
the first call by the group's first rank, sized for that call, and regrown (a new segment, named
by a generation counter every rank advances alike) when a larger message comes; every rank
sees the same sizes, so all regrow at the same op. Creation is collective: rank 0 creates and
reserves the file in ``/dev/shm`` (``posix_fallocate``, so a full tmpfs is an error here and
never a SIGBUS later), every rank maps it, all agree that this worked, and rank 0 unlinks the
name at once. The mappings stay valid until the group (and with it the :class:`ShmGroup`) goes,
so nothing is left in ``/dev/shm`` after a call, and an ``atexit`` hook unlinks a name that an
error left between its creation and that agreement. When the segment cannot be made (tmpfs
full, ranks on different hosts after all) every rank learns so together and the call takes the
all-to-all algorithm instead.

Waiting polls the counters for 20 us, then sleeps on a doorbell: each rank owns a FIFO (made
and unlinked with the first segment, like it) that its peers write a byte to after every
counter they publish; ``select`` on it wakes the waiter. Sleeping in the kernel matters when
ranks outnumber free cores (4 ranks on 2 shared cores): a spinning or yielding waiter kept the
very peer it waits for off the CPU and cost ~0.5 ms per call, as measured on a loaded host.
Stale bytes only cause a re-check, and a sleep lasts at most 0.1 s, so a lost ring costs time,
never correctness. A peer that has not arrived within the group's timeout fails the call with
:class:`CollectiveTimeoutError` naming the op and the missing ranks, as gloo's own timeout would.

[Note: shared-memory reduce-scatter]
The same protocol (:meth:`ShmGroup._exchange`: same segment, counters and doorbells, so
all-gathers and reduce-scatters of one group may interleave freely) with other slots: each rank
copies the blocks of its input meant for its peers into its region of the segment (its own
block stays where it is, so a rank writes (n-1)/n of its input, the bytes a socket algorithm
sends), publishes, and reduces each peer's block for it as soon as that peer has arrived,
straight from the segment into the output: ``out = own (op) first peer``, then ``out (op)=``
each next one, one pass per peer and no scratch buffer (:func:`~ds_comm._algorithms.reduce_into`).
Over TCP the same message costs a copy into the kernel, one out of it, and a wake-up per
chunk before the reduction can start. With more than two ranks fp16/bf16 are summed in fp32 and
rounded once; dtypes without CPU arithmetic use :func:`~ds_comm._algorithms.accumulate_dtype`.
Blocks may differ in size per destination (the list form), as long as every rank passes the same
sizes. The segment holds (n-1) x the input (every rank's region). A reduce op the local
kernels lack is refused before this rank writes anything.

[Note: memory ordering of the shm protocol]
A rank copies its block into shared memory and then stores its sequence number; a peer loads the
sequence number and then reads the block; after reading it stores its acknowledgement, which
must not overtake those reads. This is correct when stores become visible in program order,
loads are not reordered with each other and no store moves ahead of an earlier load, which
x86-64's TSO guarantees for ordinary stores and loads. torch's copy (``memcpy``) may use non-temporal stores for large blocks, which
TSO does not order, but glibc's non-temporal memcpy ends with ``sfence``, so the block is
globally visible before the copy returns and before the counter store that follows. Counters are
aligned 8-byte stores and loads through a ``memoryview`` (one ``mov``: atomic on x86-64), each
on its own 64-byte cache line. Weaker memory models (ARM, POWER) would need explicit fences that
Python cannot issue, so the path is limited to x86-64 (:data:`SUPPORTED`); other machines keep
the socket algorithms.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import mmap
import os
import platform
import select
import socket
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ds_comm._algorithms import (
    LOCAL_OPS,
    Pending,
    accumulate_dtype,
    average,
    overlaps,
    reduce_into,
    wire,
)
from ds_comm._forensics import _pg_timeout_s
from ds_comm.api import CollectiveTimeoutError

__all__ = ["PREFIX", "SHM_DIR", "SUPPORTED", "ShmGroup", "shm_group"]

SHM_DIR = "/dev/shm"
PREFIX = "ds-comm-"
# See [Note: memory ordering of the shm protocol].
SUPPORTED = platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)

_LINE = 64  # bytes per counter: one cache line each
_Q_PER_LINE = _LINE // 8
_PAGE = 4096
_SPIN_S = 20e-6  # poll this long before sleeping on the doorbell
_MAX_SLEEP_S = 0.1  # doorbell sleeps are capped so a missed ring costs at most this

# Names this process created and has not unlinked yet (unlinked at exit if an error left one).
_CREATED: set[str] = set()


def _unlink_created() -> None:
    for path in list(_CREATED):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        _CREATED.discard(path)


atexit.register(_unlink_created)


class _Segment:
    """One mapped segment: ``2 n`` counters (arrived, read) on cache lines, then the data area."""

    def __init__(self, fd: int, n: int, capacity: int) -> None:
        self.header_bytes = _Segment.size(n, 0)
        self.capacity = capacity
        self.mm = mmap.mmap(fd, self.header_bytes + capacity)
        self.counters = memoryview(self.mm)[: self.header_bytes].cast("q")
        self.data = torch.frombuffer(
            self.mm, dtype=torch.uint8, offset=self.header_bytes, count=capacity
        )

    @staticmethod
    def size(n: int, capacity: int) -> int:
        """Bytes of a segment for ``n`` ranks and ``capacity`` bytes of data (header in pages)."""
        return -(-2 * n * _LINE // _PAGE) * _PAGE + capacity


class _Doorbells:
    """This rank's FIFO to sleep on and its peers' FIFOs to ring; see [Note: shared-memory
    all-gather]. Made collectively; the names are unlinked once every rank has opened them."""

    def __init__(self, group: ShmGroup) -> None:
        own = f"{group.name}-bell-{group.me}"
        path = os.path.join(SHM_DIR, own)
        self.fds: list[int] = []
        self.peers: list[int] = []
        self.own = -1
        ok = True
        try:
            os.mkfifo(path, 0o600)
            _CREATED.add(path)
            self.own = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            self.fds.append(self.own)
        except OSError:
            ok = False
        if group.agree(ok):  # every reader is open: writers can open without blocking
            try:
                for r in range(group.n):
                    if r != group.me:
                        peer = os.path.join(SHM_DIR, f"{group.name}-bell-{r}")
                        self.peers.append(os.open(peer, os.O_WRONLY | os.O_NONBLOCK))
                        self.fds.append(self.peers[-1])
            except OSError:
                ok = False
        ok = group.agree(ok)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        _CREATED.discard(path)
        group.agree(True)  # no rank returns while a name still exists
        self.ok = ok
        self._closer = weakref.finalize(self, _close_all, list(self.fds))

    def ring(self) -> None:
        for fd in self.peers:
            with contextlib.suppress(BlockingIOError, BrokenPipeError):  # full: already rung
                os.write(fd, b"\0")

    def sleep(self, timeout_s: float) -> None:
        """Until a peer rings (or ``timeout_s``); clears the rings so far."""
        if select.select([self.own], [], [], max(0.0, timeout_s))[0]:
            with contextlib.suppress(BlockingIOError):
                os.read(self.own, 4096)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


_ARRIVED, _READ = 0, 1


class ShmGroup:
    """A group's shared segment and its op counter; see [Note: shared-memory all-gather]."""

    def __init__(self, group: Any, ranks: Sequence[int], me: int) -> None:
        self.group = group
        self.ranks = tuple(ranks)
        self.me = me
        self.n = len(ranks)
        self.timeout_s = _pg_timeout_s(group)
        self.seq = 0
        self.generation = 0
        self.segment: _Segment | None = None
        self.last: Pending | None = None
        self.usable = True  # False once creating a segment failed on some rank
        self.bells: _Doorbells | None = None
        hosts: list[Any] = [None] * self.n
        dist.all_gather_object(hosts, (socket.gethostname(), uuid.uuid4().hex[:12]), group=group)
        self.same_host = all(host == hosts[0][0] for host, _ in hosts)
        self.name = f"{PREFIX}{hosts[0][1]}"

    def all_gather(
        self, outputs: torch.Tensor | Sequence[torch.Tensor], input: torch.Tensor, op: str
    ) -> Pending | None:
        """Gather contiguous ``input`` from every rank into contiguous ``outputs``.

        ``outputs`` is one tensor holding every rank's block in group order (blocks the size of
        ``input``), or one tensor per rank, each of that rank's size (sizes may differ per
        rank; every rank passes the same sizes). Returns None (on every rank alike) when no
        segment can hold the message.
        """
        own, me = wire(input), self.me
        flat = wire(outputs) if isinstance(outputs, torch.Tensor) else None
        if flat is not None:
            offsets = [r * own.numel() for r in range(self.n + 1)]
        else:
            offsets = list(itertools.accumulate((t.nbytes for t in outputs), initial=0))

        def dest(r: int) -> torch.Tensor:
            return flat[offsets[r] : offsets[r + 1]] if flat is not None else wire(outputs[r])

        def write(data: torch.Tensor) -> None:
            data[offsets[me] : offsets[me + 1]].copy_(own)

        def read(r: int, data: torch.Tensor) -> None:
            dest(r).copy_(data[offsets[r] : offsets[r + 1]])

        pending = self._exchange(offsets[-1], write, read, None, op)
        mine = dest(me) if pending is not None else own
        if mine.data_ptr() != own.data_ptr():  # not in place
            mine.copy_(own)  # while the peers arrive
        return pending

    def reduce_scatter(
        self,
        output: torch.Tensor,
        inputs: torch.Tensor | Sequence[torch.Tensor],
        redop: Any,
        op: str,
    ) -> Pending | None:
        """Reduce the blocks for rank r of every rank's ``inputs`` into rank r's ``output``.

        ``inputs`` is one tensor holding the blocks for every rank in group order (each the size
        of ``output``), or one tensor per rank, each of that rank's output size (sizes may differ
        per rank; every rank passes the same sizes); all contiguous, in ``output``'s dtype.
        ``output`` may be this rank's own block of the input (in place). See [Note:
        shared-memory reduce-scatter]. Returns None (on every rank alike) when no segment can
        hold the message.
        """
        if redop not in LOCAL_OPS:  # refused before any rank writes: none is left waiting
            raise ValueError(f"{op} (shm): reduce op {redop} is not supported")
        n, me = self.n, self.me
        if isinstance(inputs, torch.Tensor):
            source, size = wire(inputs), output.nbytes
            sizes = [size] * n
            blocks = [source[j * size : (j + 1) * size] for j in range(n)]
        else:
            blocks = [wire(t) for t in inputs]
            sizes = [b.numel() for b in blocks]
        starts = list(itertools.accumulate(sizes, initial=0))
        total = starts[-1]
        # Rank r's region holds its blocks for its peers, in rank order (its own is skipped).
        regions = [r * total - starts[r] for r in range(n + 1)]

        def where(r: int, j: int) -> int:  # offset of rank r's block for rank j (j != r)
            return regions[r] + starts[j] - (sizes[r] if r < j else 0)

        def write(data: torch.Tensor) -> None:
            for j in range(n):
                if j != me:
                    data[where(me, j) : where(me, j) + sizes[j]].copy_(blocks[j])

        own = blocks[me].view(output.dtype)
        wide = accumulate_dtype(output.dtype)
        if n > 2 and wide.is_floating_point and wide.itemsize < 4:
            wide = torch.float32  # more than one rounding: sum fp16/bf16 in fp32
        flat_out = output.view(-1)
        in_place = flat_out.data_ptr() == own.data_ptr()
        direct = wide == output.dtype and (in_place or not overlaps(flat_out, own))
        acc = flat_out if direct else torch.empty(own.numel(), dtype=wide)
        arrived = 0

        def read(r: int, data: torch.Tensor) -> None:
            nonlocal arrived
            peer = data[where(r, me) : where(r, me) + sizes[me]].view(output.dtype)
            first = own if arrived == 0 else acc
            if wide != output.dtype:
                peer, first = peer.to(wide), first.to(wide)
            reduce_into(acc, first, peer, redop)
            arrived += 1

        def done() -> None:
            if arrived == 0 and acc.data_ptr() != own.data_ptr():  # one rank: nothing to reduce
                acc.copy_(own)
            if redop == ReduceOp.AVG:
                average(acc, n)
            if acc is not flat_out:
                flat_out.copy_(acc)

        return self._exchange(regions[n], write, read, done, op)

    def _exchange(
        self,
        nbytes: int,
        write: Callable[[torch.Tensor], None],
        read: Callable[[int, torch.Tensor], None],
        done: Callable[[], None] | None,
        op: str,
    ) -> Pending | None:
        """One op of the protocol in [Note: shared-memory all-gather] over ``nbytes`` of slots.

        ``write(data)`` fills this rank's slots now; ``wait()`` on the result calls ``read(r,
        data)`` for each peer r as soon as it has arrived, then ``done()``. Returns None (on
        every rank alike) when no segment can hold ``nbytes``.
        """
        if self.last is not None:
            self.last.wait()  # ops complete in order: the previous one's slots are read
        if not self._ensure(nbytes):
            return None
        seg = self.segment
        assert seg is not None
        self.seq += 1
        seq = self.seq
        self._wait(seg, _READ, seq - 1, range(self.n), op, "finish reading the previous op")
        write(seg.data)
        self._publish(seg, _ARRIVED, seq)

        def finish() -> None:
            for k in range(1, self.n):  # each peer as soon as it has arrived
                r = (self.me + k) % self.n
                self._wait(seg, _ARRIVED, seq, range(r, r + 1), op, "arrive")
                read(r, seg.data)
            self._publish(seg, _READ, seq)
            if self.last is pending:
                self.last = None  # do not keep the caller's tensors alive
            if done is not None:
                done()

        pending = self.last = Pending(finish=finish)
        return pending

    def _index(self, kind: int, rank: int) -> int:
        return (kind * self.n + rank) * _Q_PER_LINE

    def _wait(self, seg: _Segment, kind: int, seq: int, ranks: range, op: str, what: str) -> None:
        """Wait until the counters of group indices ``ranks`` reach ``seq``.

        On timeout the error names every group rank whose counter is behind, not only ``ranks``.
        """
        counters = seg.counters
        slots = [self._index(kind, r) for r in ranks]
        start = 0.0
        while True:
            if all(counters[i] >= seq for i in slots):
                return
            now = time.perf_counter()
            if start == 0.0:
                start = now
            elapsed = now - start
            if elapsed < _SPIN_S:
                continue
            if elapsed > self.timeout_s:
                missing = [
                    rank
                    for r, rank in enumerate(self.ranks)
                    if counters[self._index(kind, r)] < seq
                ]
                raise CollectiveTimeoutError(
                    f"{op} (shm) #{seq} on group ranks {list(self.ranks)}: timed out after "
                    f"{elapsed:.1f} s waiting for ranks {missing} to {what}; they never "
                    "reached this op (check that every rank calls it, or raise the group timeout)"
                )
            assert self.bells is not None  # made with the first segment
            self.bells.sleep(min(_MAX_SLEEP_S, self.timeout_s - elapsed + 1e-3))

    def _publish(self, seg: _Segment, kind: int, seq: int) -> None:
        seg.counters[self._index(kind, self.me)] = seq
        assert self.bells is not None
        self.bells.ring()

    def _ensure(self, nbytes: int) -> bool:
        """Make the segment hold ``nbytes`` of data (collective when it must grow)."""
        if self.segment is not None and self.segment.capacity >= nbytes:
            return True
        if not self.usable:
            return False
        if self.bells is None:
            self.bells = _Doorbells(self)
            self.usable = self.bells.ok
            if not self.usable:
                return False
        old = self.segment.capacity if self.segment is not None else 0
        capacity = -(-max(nbytes, 2 * old, 1) // _PAGE) * _PAGE
        self.segment = None  # a peer still reading the old one keeps its own mapping of it
        self.generation += 1
        path = os.path.join(SHM_DIR, f"{self.name}-{self.generation}")
        fd, ok = -1, True
        if self.me == 0:
            try:
                fd, ok = _create(path, _Segment.size(self.n, capacity))
            except OSError:
                ok = False
        if self.agree(ok):  # the file exists before the others open it
            try:
                fd = os.open(path, os.O_RDWR) if self.me != 0 else fd
                self.segment = _Segment(fd, self.n, capacity)
            except OSError:
                ok = False
            finally:
                if fd >= 0:
                    os.close(fd)  # the mapping keeps the memory
        elif fd >= 0:
            os.close(fd)
        ok = self.agree(ok)  # every rank has mapped it (or given up): the name can go
        if self.me == 0 and path in _CREATED:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            _CREATED.discard(path)
        self.agree(True)  # no rank returns while the name still exists
        if not ok:
            self.segment = None
            self.usable = False
        self.seq = 0  # the new segment's counters start at zero
        return ok

    def agree(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (a collective over the group)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())


def _create(path: str, size: int) -> tuple[int, bool]:
    """Create and reserve ``size`` bytes at ``path``; (fd or -1, whether it worked)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    _CREATED.add(path)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:
        os.close(fd)
        return -1, False
    return fd, True


_SHM_GROUPS: weakref.WeakKeyDictionary[Any, ShmGroup] = weakref.WeakKeyDictionary()


def shm_group(group: Any, ranks: Sequence[int], me: int) -> ShmGroup:
    """The :class:`ShmGroup` of ``group`` (created at first use: a collective over the group)."""
    pg = dist.group.WORLD if group is None else group
    state = _SHM_GROUPS.get(pg)
    if state is None:
        state = _SHM_GROUPS[pg] = ShmGroup(group, ranks, me)
    return state
