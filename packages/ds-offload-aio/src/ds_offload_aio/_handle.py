"""``AioHandle``: DeepSpeed's ``aio_handle`` API over the libaio engine or a thread pool."""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Literal, Protocol

import torch

from ds_offload_aio import _ext, _ops
from ds_offload_aio._pinned import PinnedBufferPool, allocate_locked, release_locked, round_up
from ds_offload_aio._transfer import RequestShape
from ds_offload_aio.api import ALIGNMENT, AioConfig, Backend, _check_handle_settings

PathLike = str | os.PathLike[str]
_MIB = 1 << 20


class _Waitable(Protocol):
    def result(self) -> None: ...


class IoHandleBase:
    """The settings, getters and read/write verbs both handles share; subclasses move bytes."""

    def __init__(
        self,
        block_size: int,
        queue_depth: int,
        single_submit: bool,
        overlap_events: bool,
        intra_op_parallelism: int,
    ) -> None:
        _check_handle_settings(
            type(self).__name__,
            block_size=block_size,
            queue_depth=queue_depth,
            single_submit=single_submit,
            overlap_events=overlap_events,
            intra_op_parallelism=intra_op_parallelism,
        )
        self._shape = RequestShape(block_size, single_submit, overlap_events)
        self._queue_depth = queue_depth
        self._parallelism = intra_op_parallelism
        self._pending: list[_Waitable] = []
        self._lock = threading.Lock()

    def _submit(self, request: _ops.OpRequest) -> _Waitable:
        raise NotImplementedError

    def get_block_size(self) -> int:
        return self._shape.block_size

    def get_queue_depth(self) -> int:
        return self._queue_depth

    def get_single_submit(self) -> bool:
        return self._shape.single_submit

    def get_overlap_events(self) -> bool:
        return self._shape.overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._parallelism

    def get_alignment(self) -> int:
        """Byte alignment at which offsets and memory need no head/tail or bounce handling."""
        return ALIGNMENT

    def pread(
        self,
        tensor: torch.Tensor,
        path: PathLike,
        validate: bool = False,
        async_op: bool = False,
        offset: int = 0,
    ) -> int:
        """Reads ``tensor.nbytes`` bytes of ``path`` at ``offset`` into ``tensor``.

        Returns 1 (ops completed) when synchronous, 0 when ``async_op`` (then ``wait()``). With
        ``validate`` the result is compared with a plain buffered read of the file.
        """
        return self._run(_ops.check_request(True, tensor, path, offset, validate, False), async_op)

    def pwrite(
        self,
        tensor: torch.Tensor,
        path: PathLike,
        validate: bool = False,
        async_op: bool = False,
        offset: int = 0,
        *,
        atomic: bool = False,
    ) -> int:
        """Writes ``tensor``'s bytes to ``path`` at ``offset`` (created if missing, not truncated).

        ``atomic=True`` (offset 0 only) writes a temp file beside ``path``, fsyncs it and renames
        it over ``path``: readers see the old file or the whole new one, never a part.
        """
        request = _ops.check_request(False, tensor, path, offset, validate, atomic)
        return self._run(request, async_op)

    def sync_pread(self, tensor: torch.Tensor, path: PathLike, offset: int = 0) -> int:
        """``pread`` that returns when the data is in ``tensor`` (returns 1)."""
        return self.pread(tensor, path, False, False, offset)

    def sync_pwrite(
        self, tensor: torch.Tensor, path: PathLike, offset: int = 0, *, atomic: bool = False
    ) -> int:
        """``pwrite`` that returns when the data is in the file (returns 1)."""
        return self.pwrite(tensor, path, False, False, offset, atomic=atomic)

    def async_pread(self, tensor: torch.Tensor, path: PathLike, offset: int = 0) -> int:
        """Starts a read and returns 0; ``wait()`` completes it (and raises its error)."""
        return self.pread(tensor, path, False, True, offset)

    def async_pwrite(
        self, tensor: torch.Tensor, path: PathLike, offset: int = 0, *, atomic: bool = False
    ) -> int:
        """Starts a write and returns 0; leave ``tensor`` untouched until ``wait()``."""
        return self.pwrite(tensor, path, False, True, offset, atomic=atomic)

    def wait(self) -> int:
        """Completes every async op started so far; returns how many there were.

        Raises the first failure (an ``AioError`` naming file and offset) after all have ended.
        """
        with self._lock:
            ops, self._pending = self._pending, []
        errors: list[BaseException] = []
        for op in ops:
            try:
                op.result()
            except BaseException as exc:
                errors.append(exc)
        if errors:
            first: Any = errors[0]  # add_note: Python 3.11+
            if len(errors) > 1 and hasattr(first, "add_note"):
                first.add_note(f"{len(errors) - 1} more of the {len(ops)} ops failed too")
            raise errors[0]
        return len(ops)

    def _run(self, request: _ops.OpRequest, async_op: bool) -> int:
        op = self._submit(request)
        if async_op:
            with self._lock:
                self._pending.append(op)
            return 0
        op.result()
        return 1


class AioHandle(IoHandleBase):
    """Async tensor file I/O with O_DIRECT: DeepSpeed's ``aio_handle`` (alias ``aio_handle``).

    ``intra_op_parallelism`` worker threads each own an io context; one op is cut across all of
    them, ``queue_depth`` requests of ``block_size`` bytes in flight per thread. Any size, offset
    and dtype works; CUDA and unaligned CPU memory go through page-locked bounce buffers.

    Args:
        backend: ``"auto"`` (libaio, else the thread pool with one ``AioFallbackWarning``),
            ``"libaio"`` (raise if unavailable) or ``"threads"`` (``os.preadv`` workers).

    Example:
        >>> h = AioHandle(block_size=1 << 20, queue_depth=32, intra_op_parallelism=4)
        >>> t = h.new_cpu_locked_tensor(1 << 20, torch.empty(0, dtype=torch.float32))
        >>> h.sync_pwrite(t, "/nvme/x.bin")
        1
        >>> h.async_pread(t, "/nvme/x.bin"); h.wait()
        0
        1
    """

    def __init__(
        self,
        block_size: int = 1048576,
        queue_depth: int = 128,
        single_submit: bool = False,
        overlap_events: bool = False,
        intra_op_parallelism: int = 1,
        *,
        backend: Literal["auto", "libaio", "threads"] = "auto",
    ) -> None:
        super().__init__(
            block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism
        )
        self._backend: Backend = _resolve_backend(backend)
        self._workers: _ops.WorkerPool | None = _ops.WorkerPool(
            self._backend, intra_op_parallelism, queue_depth
        )
        self._bounce: PinnedBufferPool | None = None
        self._locked: set[int] = set()
        self._stop_workers = weakref.finalize(self, self._workers.close)

    @classmethod
    def from_config(
        cls, config: AioConfig, *, backend: Literal["auto", "libaio", "threads"] = "auto"
    ) -> AioHandle:
        """A handle with the settings of an ``aio`` config section."""
        return cls(**config.handle_kwargs(), backend=backend)

    @property
    def backend(self) -> Backend:
        """``"libaio"`` or ``"threads"``: how this handle moves bytes."""
        return self._backend

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """A page-aligned, page-locked CPU tensor of ``num_elem`` elements of the example's dtype.

        Reads and writes use its memory in place (no bounce copy).
        """
        memory = allocate_locked(num_elem * example_tensor.element_size())
        tensor = memory.view(example_tensor.dtype)
        if num_elem:
            self._locked.add(tensor.data_ptr())
        return tensor

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """Unlocks a tensor from ``new_cpu_locked_tensor``; False if it is not one of them."""
        if tensor.data_ptr() not in self._locked:
            return False
        self._locked.discard(tensor.data_ptr())
        release_locked(tensor)
        return True

    def close(self) -> None:
        """Completes pending ops (raising their first error), then stops the workers."""
        try:
            self.wait()
        finally:
            self._stop_workers()
            self._workers = None
            if self._bounce is not None:
                self._bounce.close()

    def __enter__(self) -> AioHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _submit(self, request: _ops.OpRequest) -> _ops.PendingOp:
        if self._workers is None:
            raise RuntimeError("this AioHandle is closed")
        return _ops.submit(
            request, self._workers, self._shape, self._parallelism, self._bounce_pool
        )

    def _bounce_pool(self) -> PinnedBufferPool:
        """One bounce buffer per worker, big enough to keep its queue full, made on first use."""
        with self._lock:
            if self._bounce is None:
                in_flight = self._shape.block_size * self._queue_depth
                size = round_up(min(max(in_flight, 4 * _MIB), 32 * _MIB), self._shape.block_size)
                self._bounce = PinnedBufferPool(size, self._parallelism)
            return self._bounce


aio_handle = AioHandle
"""DeepSpeed's name for ``AioHandle``."""


def _resolve_backend(backend: str) -> Backend:
    if backend == "threads":
        return "threads"
    info = _ext.backend_info()
    if backend == "libaio":
        if info["reason"] is not None:
            raise RuntimeError(f"backend='libaio' is unavailable: {info['reason']}")
        return "libaio"
    if backend != "auto":
        raise ValueError(f"backend = {backend!r}: expected 'auto', 'libaio' or 'threads'")
    if info["reason"] is not None:
        _ext.warn_once(
            f"ds_offload_aio: {info['reason']}; using the thread-pool backend "
            "(os.preadv/os.pwritev), which is slower on fast NVMe"
        )
    return info["backend"]
