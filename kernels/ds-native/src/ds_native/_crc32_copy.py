"""Copy spans of a buffer and hash them as copied, in one pass (``csrc/crc32.c``, [Note:
copying while hashing]).

ds_zero's checksum threads copy a checkpoint's fp32 masters out of a mapped shard file while
they verify them, so the loader neither reads those bytes a second time nor copies them itself.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from ds_native import _ext
from ds_native._crc32 import checked_spans, native_code, native_span_crcs
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
    each = cast("Sequence[Buffer | torch.Tensor]", outs) if at is None else None
    if each is not None and len(each) != len(spans):
        raise ValueError(
            f"crc32_copy_spans: {len(spans)} spans but {len(each)} destinations; pass one each"
        )
    if at is not None and len(at) != len(spans):
        raise ValueError(
            f"crc32_copy_spans: {len(spans)} spans but {len(at)} offsets in at; pass one each"
        )
    with contextlib.ExitStack() as stack:
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
        code = native_code(simd)
        if not spans:
            return []
        if code is None:
            crcs = []
            for a, n, target, place in zip(starts, lengths, targets, places):
                target.write(view[a : a + n], place)
                crcs.append(zlib.crc32(view[a : a + n]))
            return crcs
        ffi, lib = _ext.EXTENSION.ffi, _ext.EXTENSION.lib
        if each is not None:
            addresses = [target.pointer(ffi, stack) for target in targets]
        else:
            base = ffi.cast("char *", targets[0].pointer(ffi, stack))
            addresses = [base + place for place in places]
        pointers = ffi.new("void *[]", addresses)
        kernel = lib.ds_native_crc32_copy_spans
        return native_span_crcs(kernel, view, starts, lengths, pointers, code)


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
