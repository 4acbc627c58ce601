"""Moves one contiguous byte range between memory and a file descriptor, in one worker thread.

Two movers: the libaio engine (queue_depth requests in flight on the thread's own io context) and
a plain ``os.preadv``/``os.pwritev`` loop, used by the thread-pool backend and for every buffered
(non-O_DIRECT) descriptor, where kernel AIO would run synchronously anyway.
"""

from __future__ import annotations

import ctypes
import errno
import os
from dataclasses import dataclass

from ds_offload_aio import _ext
from ds_offload_aio.api import Backend


class TransferFailure(Exception):
    """A transfer failed at ``offset``: ``code`` is an errno value, or None for a short transfer."""

    def __init__(self, code: int | None, offset: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.offset = offset
        self.message = message


@dataclass(frozen=True)
class RequestShape:
    """How a mover cuts a range into requests (the handle's settings)."""

    block_size: int
    single_submit: bool
    overlap_events: bool


def memory_view(address: int, nbytes: int) -> memoryview:
    """A writable byte view of raw memory (a tensor's storage) without copying."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _short(is_read: bool, offset: int) -> TransferFailure:
    if is_read:
        return TransferFailure(None, offset, "short read: the file ends before the range does")
    return TransferFailure(None, offset, "short write: the device accepted fewer bytes")


def posix_transfer(
    fd: int, is_read: bool, address: int, nbytes: int, offset: int, block_size: int
) -> None:
    """``os.preadv``/``os.pwritev`` in ``block_size`` pieces (each call releases the GIL)."""
    if nbytes == 0:
        return
    view = memory_view(address, nbytes)
    done = 0
    while done < nbytes:
        piece = view[done : done + min(block_size, nbytes - done)]
        try:
            if is_read:
                moved = os.preadv(fd, [piece], offset + done)
            else:
                moved = os.pwritev(fd, [piece], offset + done)
        except InterruptedError:
            continue
        except OSError as exc:
            raise TransferFailure(exc.errno, offset + done, exc.strerror or str(exc)) from None
        if moved == 0:
            raise _short(is_read, offset + done)
        done += moved


class Mover:
    """One worker thread's way of moving bytes; with libaio it owns an io context."""

    def __init__(self, backend: Backend, queue_depth: int) -> None:
        self._ctx = None
        if backend == "libaio":
            engine = _ext.ENGINE
            error = engine.ffi.new("int *")
            ctx = engine.lib.ds_aio_ctx_new(queue_depth, error)
            if ctx == engine.ffi.NULL:
                raise OSError(error[0], f"io_setup({queue_depth}): {os.strerror(error[0])}")
            self._ctx = ctx
            self._status = engine.ffi.new("ds_aio_status *")

    def close(self) -> None:
        if self._ctx is not None:
            _ext.ENGINE.lib.ds_aio_ctx_free(self._ctx)
            self._ctx = None

    def transfer(
        self,
        fd: int,
        *,
        direct: bool,
        is_read: bool,
        address: int,
        nbytes: int,
        offset: int,
        shape: RequestShape,
    ) -> None:
        """Moves ``nbytes`` at ``address`` to or from ``offset``; raises ``TransferFailure``."""
        if self._ctx is None or not direct:
            posix_transfer(fd, is_read, address, nbytes, offset, shape.block_size)
            return
        engine = _ext.ENGINE
        status = self._status
        code = engine.lib.ds_aio_transfer(
            self._ctx,
            fd,
            int(is_read),
            engine.ffi.cast("char *", address),
            nbytes,
            offset,
            shape.block_size,
            int(shape.single_submit),
            int(shape.overlap_events),
            status,
        )
        if code == engine.lib.DS_AIO_SHORT:
            raise _short(is_read, status.error_offset)
        if code:
            message = os.strerror(code)
            if code == errno.EINVAL:
                message += " (O_DIRECT needs aligned offsets, lengths and memory)"
            raise TransferFailure(code, status.error_offset, message)
