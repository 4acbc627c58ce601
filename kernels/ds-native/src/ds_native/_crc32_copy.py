"""Copy spans of a buffer and hash them as copied, in one pass (``csrc/crc32.c``, [Note:
copying while hashing]).

ds_zero's checksum threads copy a checkpoint's fp32 masters out of a mapped shard file while
they verify them, so the loader neither reads those bytes a second time nor copies them itself.
"""

from __future__ import annotations

import contextlib
import threading
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from ds_native import _ext
from ds_native._crc32 import checked_spans, native_code
from ds_native.api import Crc32Simd

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12


def crc32_copy_spans(
    data: Buffer,
    spans: Sequence[tuple[int, int]],
    outs: Sequence[Buffer | torch.Tensor] | Buffer | torch.Tensor,
    *,
    at: Sequence[int] | None = None,
    simd: Crc32Simd | None = None,
) -> list[int]:
    """Copy each ``(start, length)`` span of ``data`` to its own destination and give the
    CRC-32 of each span as copied: :func:`crc32_spans` and the copies in one pass over
    ``data``, the GIL released once (see [Note: copying while hashing] in ``csrc/crc32.c``). A
    loader that would hash a mapped file's tensors and then copy them out reads them once, and
    the CRC covers exactly the bytes it uses.

    Args:
        data: Any C-contiguous buffer, read in place (e.g. a memoryview of an mmap).
        spans: ``(start, length)`` byte ranges of ``data``, in any order.
        outs: One destination per span, each at least the span's length and sharing no memory
            with ``data``: a writable C-contiguous buffer, or a contiguous CPU tensor (written
            through its data pointer; its bytes, whatever its dtype). With ``at``, one such
            destination for every span.
        at: Where in the one destination ``outs`` each span goes, in bytes, one per span: span
            ``i`` is copied to ``outs[at[i] : at[i] + length]`` (ranges that should not
            overlap). The destination is checked once instead of once a span: for many small
            spans (a checkpoint file's tensors) that is most of the Python work a call does
            before it releases the GIL.
        simd: as for :func:`crc32`.

    Returns:
        One unsigned 32-bit CRC per span, ``zlib.crc32`` of its bytes.

    Raises:
        ValueError: a span with a negative start or length, or one that leaves ``data``; a
            destination too small, read-only, or a tensor not contiguous on the CPU; with
            ``at``, an offset that puts a span outside the destination (nothing is copied
            then).

    Example:
        >>> outs = [bytearray(5), torch.empty(5, dtype=torch.uint8)]
        >>> ds_native.crc32_copy_spans(b"hello world", [(0, 5), (6, 5)], outs)
        [907060870, 980881731]
        >>> ds_native.crc32_copy_spans(b"hello world", [(0, 5), (6, 5)], bytearray(10), at=[5, 0])
        [907060870, 980881731]
    """
    with Crc32CopyJob(data, spans, outs, at=at, simd=simd) as job:
        job.run()
        return job.crcs()


class Crc32CopyJob:
    """:func:`crc32_copy_spans` as one job that any number of threads run together: each
    :meth:`run` copies and hashes the spans no caller has taken yet, one after another, until
    none is left, with the GIL released throughout (see [Note: spans shared among threads] in
    ``csrc/crc32.c``). A thread can copy a file while the loader reads, and the loader take its
    share of what is left once it is done, neither of them taking the GIL back between spans.
    The arguments are those of :func:`crc32_copy_spans`, checked here (the same ValueErrors);
    the buffers are held until :meth:`close`.

    Example:
        >>> with ds_native.Crc32CopyJob(data, spans, out, at=offsets) as job:
        ...     helper = threading.Thread(target=job.run)
        ...     helper.start()
        ...     job.run()  # takes the spans the helper has not
        ...     helper.join()
        ...     crcs = job.crcs()
    """

    def __init__(
        self,
        data: Buffer,
        spans: Sequence[tuple[int, int]],
        outs: Sequence[Buffer | torch.Tensor] | Buffer | torch.Tensor,
        *,
        at: Sequence[int] | None = None,
        simd: Crc32Simd | None = None,
    ) -> None:
        each = cast("Sequence[Buffer | torch.Tensor]", outs) if at is None else None
        if each is not None and len(each) != len(spans):
            raise ValueError(
                f"crc32_copy_spans: {len(spans)} spans but {len(each)} destinations; pass one each"
            )
        if at is not None and len(at) != len(spans):
            raise ValueError(
                f"crc32_copy_spans: {len(spans)} spans but {len(at)} offsets in at; pass one each"
            )
        self._stack = stack = contextlib.ExitStack()
        try:
            view = stack.enter_context(memoryview(data).cast("B"))
            starts, lengths = checked_spans("crc32_copy_spans", spans, view.nbytes)
            if each is not None:
                targets = [
                    stack.enter_context(_Destination(out, n, i))
                    for i, (out, n) in enumerate(zip(each, lengths))
                ]
                places = [0] * len(spans)
            else:
                one = stack.enter_context(_Destination(cast("Buffer | torch.Tensor", outs), 0, 0))
                places = [int(a) for a in at or ()]
                _check_places(places, lengths, one.capacity)
                targets = [one] * len(spans)
            self._count = len(spans)
            self._native: tuple[Any, ...] | None = None
            self._python: tuple[Any, ...] | None = None
            code = native_code(simd)
            if code is None or not spans:  # copied by Python, hashed by zlib
                self._lock, self._next = threading.Lock(), 0
                self._python = (view, starts, lengths, targets, places)
                self._out: Any = [0] * len(spans)
                return
            ffi, lib = _ext.EXTENSION.ffi, _ext.EXTENSION.lib
            if each is not None:
                addresses = [target.pointer(ffi, stack) for target in targets]
            else:
                base = ffi.cast("char *", targets[0].pointer(ffi, stack))
                addresses = [base + place for place in places]
            self._cursor = ffi.new("uint64_t *")
            self._out = ffi.new("uint32_t[]", len(spans))
            self._native = (
                lib.ds_native_crc32_copy_spans_shared,
                stack.enter_context(ffi.from_buffer(view)),
                view.nbytes,
                ffi.new("uint64_t[]", starts),
                ffi.new("uint64_t[]", lengths),
                len(spans),
                ffi.new("void *[]", addresses),
                code,
                self._out,
                self._cursor,
            )
        except BaseException:
            stack.close()
            raise

    def run(self) -> None:
        """Copy and hash spans no caller has taken yet until none is left (the GIL released
        throughout); from any number of threads at once."""
        if self._native is not None:
            kernel, *args = self._native
            status = kernel(*args)
            assert status == 0  # the spans were checked
            return
        if self._python is None:
            raise RuntimeError("Crc32CopyJob.run() after close()")
        view, starts, lengths, targets, places = self._python
        while True:
            with self._lock:
                i, self._next = self._next, self._next + 1
            if i >= self._count:
                return
            a, n = starts[i], lengths[i]
            targets[i].write(view[a : a + n], places[i])
            self._out[i] = zlib.crc32(view[a : a + n])

    def stop(self) -> None:
        """Leave the spans no caller has taken yet uncopied (their CRC-32s read 0): a
        :meth:`run` under way returns after the span it is copying."""
        if self._native is not None:
            _ext.EXTENSION.lib.ds_native_crc32_copy_stop(self._cursor, self._count)
        elif self._python is not None:
            with self._lock:
                self._next = self._count

    def crcs(self) -> list[int]:
        """The CRC-32 of each span as copied, ``zlib.crc32`` of its bytes; final once every
        :meth:`run` has returned."""
        return list(self._out)

    def close(self) -> None:
        """Let go of the buffers, once no :meth:`run` is under way (:meth:`crcs` still
        answers)."""
        self._out = list(self._out)
        self._native = self._python = None
        self._stack.close()

    def __enter__(self) -> Crc32CopyJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_places(places: list[int], lengths: list[int], capacity: int) -> None:
    """Refuse an offset of ``at`` that puts its span outside the one destination."""
    for i, (place, n) in enumerate(zip(places, lengths)):
        if place < 0 or place + n > capacity:
            raise ValueError(
                f"crc32_copy_spans: span {i} would go to bytes [{place}, {place + n}) of the "
                f"destination, which holds {capacity}; pass offsets in at that keep every span "
                "inside it"
            )


class _Destination:
    """One destination of :func:`crc32_copy_spans`, checked: a writable buffer or a CPU tensor."""

    def __init__(self, out: Buffer | torch.Tensor, length: int, index: int) -> None:
        self._tensor: torch.Tensor | None = None
        self._view: memoryview | None = None
        if isinstance(out, torch.Tensor):
            if out.device.type != "cpu" or not out.is_contiguous():
                raise ValueError(
                    f"crc32_copy_spans: destination {index} is a {out.device.type} tensor"
                    f"{'' if out.is_contiguous() else ' not contiguous'}; pass a contiguous "
                    "CPU tensor"
                )
            self._tensor, capacity = out, out.numel() * out.element_size()
        else:
            self._view = memoryview(out).cast("B")
            capacity = self._view.nbytes
            if self._view.readonly:
                self._view.release()
                raise ValueError(f"crc32_copy_spans: destination {index} is read-only")
        self.capacity = capacity
        if capacity < length:
            self.__exit__()
            raise ValueError(
                f"crc32_copy_spans: span {index} holds {length} bytes, its destination only "
                f"{capacity}; pass one of at least the span's length"
            )

    def write(self, data: memoryview, at: int = 0) -> None:
        """Copy ``data`` to byte ``at`` of the destination (the path without the C kernel)."""
        if self._tensor is not None:
            if not data.nbytes:
                return  # torch.frombuffer refuses an empty buffer
            target = self._tensor.view(-1).view(torch.uint8)[at : at + data.nbytes]
            target.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        else:
            assert self._view is not None
            self._view[at : at + data.nbytes] = data

    def pointer(self, ffi: Any, stack: contextlib.ExitStack) -> Any:
        """The destination's address for C, valid while ``stack`` is open."""
        if self._tensor is not None:
            return ffi.cast("void *", self._tensor.data_ptr())
        return stack.enter_context(ffi.from_buffer(self._view))

    def __enter__(self) -> _Destination:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._view is not None:
            self._view.release()
