"""One read or write op: planned into segments, run by worker threads, finished by its waiter.

[Note: how an op is cut]
The byte range ``[offset, offset + nbytes)`` of the file splits at 4 KiB boundaries into an
unaligned head, an aligned body and an unaligned tail. The body goes through the O_DIRECT
descriptor, cut into ``intra_op_parallelism`` slices (multiples of 4 KiB) that the workers move
concurrently, each with its own io context. Head and tail (under 4 KiB each) go through the
buffered descriptor (see [Note: two descriptors per file] in _files.py), so any size and any
offset work without read-modify-write of partial blocks, and concurrent ops on neighbouring
ranges of one file never touch each other's bytes.

A slice is moved in place when the tensor is CPU memory at an address O_DIRECT accepts for it
(``new_cpu_locked_tensor``, pool buffers, any page-aligned storage); otherwise (pageable memory at
other addresses, CUDA tensors) it is staged through the handle's page-locked bounce buffers,
one per worker, piece by piece.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ds_offload_aio import _files
from ds_offload_aio._pinned import PinnedBufferPool, round_up
from ds_offload_aio._transfer import Mover, RequestShape, TransferFailure, posix_transfer
from ds_offload_aio.api import ALIGNMENT, AioError, Backend


class WorkerPool:
    """``threads`` workers taking jobs from one queue; each owns a ``Mover`` (io context)."""

    def __init__(self, backend: Backend, threads: int, queue_depth: int) -> None:
        self._jobs: queue.SimpleQueue[Callable[[Mover], None] | None] = queue.SimpleQueue()
        movers: list[Mover] = []
        try:
            movers.extend(Mover(backend, queue_depth) for _ in range(threads))
        except BaseException:
            for mover in movers:
                mover.close()
            raise
        self._threads = [
            threading.Thread(target=self._work, args=(m,), name=f"ds-aio-{i}", daemon=True)
            for i, m in enumerate(movers)
        ]
        for thread in self._threads:
            thread.start()

    def _work(self, mover: Mover) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                job(mover)
        finally:
            mover.close()

    def submit(self, job: Callable[[Mover], None]) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        """Stops the workers after the jobs already queued."""
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()
        self._threads = []


class PendingOp:
    """An op in flight: counts its segments down, then its waiter finishes it in ``result()``."""

    def __init__(self, kind: str, path: str) -> None:
        self.kind = kind
        self.path = path
        self._remaining = 0
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._errors: list[BaseException] = []
        self._finish: Callable[[bool], None] | None = None
        self._outcome: BaseException | None = None
        self._finished = False

    def start(self, segments: int, finish: Callable[[bool], None]) -> None:
        self._finish = finish
        self._remaining = segments
        if segments == 0:
            self._done.set()

    def fail(self, error: BaseException) -> None:
        """The op failed before any segment was queued."""
        self._errors.append(error)
        self._done.set()

    def segment_done(self, error: BaseException | None) -> None:
        with self._lock:
            if error is not None:
                self._errors.append(error)
            self._remaining -= 1
            if self._remaining == 0:
                self._done.set()

    def result(self) -> None:
        """Waits for every segment, closes (or commits) the file; raises the first error."""
        self._done.wait()
        if not self._finished:
            self._finished = True
            if self._errors:
                self._outcome = min(self._errors, key=lambda e: getattr(e, "offset", 0))
            if self._finish is not None:
                try:
                    self._finish(self._outcome is None)
                except BaseException as exc:
                    self._outcome = self._outcome or exc
        if self._outcome is not None:
            raise self._outcome


@dataclass(frozen=True)
class Segment:
    """Bytes ``[start, start + nbytes)`` of the tensor <-> file bytes at ``offset``."""

    offset: int
    nbytes: int
    start: int
    direct: bool


def plan(offset: int, nbytes: int, parallelism: int, direct: bool) -> list[Segment]:
    """Cuts a range into head, body slices and tail; see [Note: how an op is cut]."""
    end = offset + nbytes
    lo, hi, grain = (round_up(offset, ALIGNMENT), end // ALIGNMENT * ALIGNMENT, ALIGNMENT)
    if not direct:
        lo, hi, grain = offset, end, 1
    if lo >= hi:
        return [Segment(offset, nbytes, 0, False)] if nbytes else []
    segments = [Segment(offset, lo - offset, 0, False)] if lo > offset else []
    step = round_up(-(-(hi - lo) // parallelism), grain)
    segments += [Segment(s, min(step, hi - s), s - offset, direct) for s in range(lo, hi, step)]
    if end > hi:
        segments.append(Segment(hi, end - hi, hi - offset, False))
    return segments


@dataclass(frozen=True)
class OpRequest:
    """What the caller asked for, checked, with everything the workers need."""

    is_read: bool
    tensor: torch.Tensor
    path: str
    offset: int
    validate: bool
    atomic: bool

    @property
    def flat(self) -> torch.Tensor:
        return self.tensor.reshape(-1).view(torch.uint8)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def in_place(self, segment: Segment) -> bool:
        """Whether the segment can use the tensor's memory directly (no bounce buffer)."""
        if self.tensor.device.type != "cpu":
            return False
        return not segment.direct or (self.tensor.data_ptr() + segment.start) % ALIGNMENT == 0


def submit(
    request: OpRequest,
    workers: WorkerPool,
    shape: RequestShape,
    parallelism: int,
    bounce: Callable[[], PinnedBufferPool],
) -> PendingOp:
    """Opens the file, plans the segments and queues them; failures surface from ``result()``."""
    op = PendingOp("read" if request.is_read else "write", request.path)
    try:
        if request.is_read:
            opened = _files.open_for_read(
                request.path, offset=request.offset, nbytes=request.nbytes
            )
        else:
            opened = _files.open_for_write(
                request.path, offset=request.offset, nbytes=request.nbytes, atomic=request.atomic
            )
    except AioError as exc:
        op.fail(exc)
        return op
    try:
        segments = plan(request.offset, request.nbytes, parallelism, opened.direct_fd is not None)
        pool = None if all(request.in_place(s) for s in segments) else bounce()
    except BaseException:
        _files.abort(opened)
        raise
    running = _RunningOp(op, request, opened, shape, pool)
    op.start(len(segments), running.finish)
    for segment in segments:
        workers.submit(lambda mover, s=segment: running.run(mover, s))
    return op


@dataclass(frozen=True)
class _RunningOp:
    """What the workers and the waiter of one op share once its file is open."""

    op: PendingOp
    request: OpRequest
    opened: _files.OpenFile
    shape: RequestShape
    pool: PinnedBufferPool | None  # bounce buffers, when some segment needs them

    def run(self, mover: Mover, segment: Segment) -> None:
        """A worker's job: move one segment, report how it went (never raises)."""
        try:
            self._move(mover, segment)
        except TransferFailure as failure:
            self.op.segment_done(
                AioError(failure.code, failure.message, self.request.path,
                         offset=failure.offset, op=self.op.kind)
            )  # fmt: skip
        except BaseException as exc:  # e.g. a CUDA copy failed; the waiter re-raises it
            self.op.segment_done(exc)
        else:
            self.op.segment_done(None)

    def _move(self, mover: Mover, segment: Segment) -> None:
        request, pool = self.request, self.pool
        fd = self.opened.direct_fd if segment.direct else self.opened.buffered_fd
        assert fd is not None

        def transfer(address: int, nbytes: int, offset: int) -> None:
            mover.transfer(
                fd, direct=segment.direct, is_read=request.is_read, address=address,
                nbytes=nbytes, offset=offset, shape=self.shape,
            )  # fmt: skip

        if pool is None or request.in_place(segment):
            transfer(request.tensor.data_ptr() + segment.start, segment.nbytes, segment.offset)
            return
        flat = request.flat
        buffer = pool.acquire()
        try:
            for at in range(0, segment.nbytes, pool.buffer_bytes):
                size = min(pool.buffer_bytes, segment.nbytes - at)
                window = flat[segment.start + at : segment.start + at + size]
                if not request.is_read:
                    buffer[:size].copy_(window)
                transfer(buffer.data_ptr(), size, segment.offset + at)
                if request.is_read:
                    window.copy_(buffer[:size])
        finally:
            pool.release(buffer)

    def finish(self, ok: bool) -> None:
        """The waiter's part: validate, then close (read) or commit (write); abort on failure."""
        if not ok:
            _files.abort(self.opened)
            return
        try:
            if self.request.validate:
                _validate(self.request, self.opened, self.shape)
        except BaseException:
            _files.abort(self.opened)
            raise
        if self.request.is_read:
            self.opened.close()
        else:
            _files.commit(self.opened)


def _validate(request: OpRequest, opened: _files.OpenFile, shape: RequestShape) -> None:
    """Compares the tensor with a plain buffered read of the file range (DeepSpeed's validate)."""
    reference = torch.empty(request.nbytes, dtype=torch.uint8)
    try:
        posix_transfer(
            opened.buffered_fd,
            True,
            reference.data_ptr(),
            request.nbytes,
            request.offset,
            shape.block_size,
        )
    except TransferFailure as failure:
        raise AioError(
            failure.code, f"validation: {failure.message}", request.path,
            offset=failure.offset, op="validate",
        ) from None  # fmt: skip
    mismatch = (reference != request.flat.cpu()).nonzero()
    if mismatch.numel():
        first = int(mismatch[0])
        raise AioError(
            None,
            f"validation: {mismatch.numel()} bytes differ from a buffered read of the file",
            request.path,
            offset=request.offset + first,
            op="validate",
        )


def check_request(
    is_read: bool,
    tensor: torch.Tensor,
    path: str | os.PathLike[str],
    offset: int,
    validate: bool,
    atomic: bool,
) -> OpRequest:
    """Argument errors are the caller's bugs: raised at once, not deferred to ``wait()``."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor buffer, got {type(tensor).__name__}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset = {offset!r}: expected a non-negative integer")
    if is_read and not tensor.is_contiguous():
        raise ValueError("pread needs a contiguous tensor to read into (call .contiguous())")
    if atomic and offset != 0:
        raise ValueError(f"atomic=True replaces the whole file: offset must be 0 (got {offset})")
    if not is_read:
        tensor = tensor.contiguous()
    return OpRequest(is_read, tensor, os.fspath(path), offset, validate, atomic)
