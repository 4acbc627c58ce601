"""Copy spans of a buffer and hash them as copied, in one pass (``csrc/crc32.c``, [Note:
copying while hashing]).

ds_zero's checksum threads copy a checkpoint's fp32 masters out of a mapped shard file while
they verify them, so the loader neither reads those bytes a second time nor copies them itself.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ds_native import _ext
from ds_native._crc32 import checked_spans, native_code, native_span_crcs
from ds_native.api import Crc32Simd

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12


def crc32_copy_spans(
    data: Buffer,
    spans: Sequence[tuple[int, int]],
    outs: Sequence[Buffer | torch.Tensor],
    *,
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
            through its data pointer; its bytes, whatever its dtype).
        simd: as for :func:`crc32`.

    Returns:
        One unsigned 32-bit CRC per span, ``zlib.crc32`` of its bytes.

    Raises:
        ValueError: a span with a negative start or length, or one that leaves ``data``; a
            destination too small, read-only, or a tensor not contiguous on the CPU (nothing
            is copied then).

    Example:
        >>> outs = [bytearray(5), torch.empty(5, dtype=torch.uint8)]
        >>> ds_native.crc32_copy_spans(b"hello world", [(0, 5), (6, 5)], outs)
        [907060870, 980881731]
    """
    if len(outs) != len(spans):
        raise ValueError(
            f"crc32_copy_spans: {len(spans)} spans but {len(outs)} destinations; pass one each"
        )
    with contextlib.ExitStack() as stack:
        view = stack.enter_context(memoryview(data).cast("B"))
        starts, lengths = checked_spans("crc32_copy_spans", spans, view.nbytes)
        targets = [
            stack.enter_context(_Destination(out, n, i))
            for i, (out, n) in enumerate(zip(outs, lengths))
        ]
        code = native_code(simd)
        if not spans:
            return []
        if code is None:
            crcs = []
            for a, n, target in zip(starts, lengths, targets):
                target.write(view[a : a + n])
                crcs.append(zlib.crc32(view[a : a + n]))
            return crcs
        ffi, lib = _ext.EXTENSION.ffi, _ext.EXTENSION.lib
        pointers = ffi.new("void *[]", [target.pointer(ffi, stack) for target in targets])
        kernel = lib.ds_native_crc32_copy_spans
        return native_span_crcs(kernel, view, starts, lengths, pointers, code)


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
        if capacity < length:
            self.__exit__()
            raise ValueError(
                f"crc32_copy_spans: span {index} holds {length} bytes, its destination only "
                f"{capacity}; pass one of at least the span's length"
            )

    def write(self, data: memoryview) -> None:
        """Copy ``data`` to the start of the destination (the path without the C kernel)."""
        if self._tensor is not None:
            if not data.nbytes:
                return  # torch.frombuffer refuses an empty buffer
            target = self._tensor.view(-1).view(torch.uint8)[: data.nbytes]
            target.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        else:
            assert self._view is not None
            self._view[: data.nbytes] = data

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
