"""CRC-32 with zlib's values at memory speed (``csrc/crc32.c``, [Note: CRC-32 folding]).

ds_zero checksums every checkpoint chunk with CRC-32; zlib's table-driven loop runs at ~2 GB/s,
the carry-less-multiply kernel here at several times that, so verifying a checkpoint costs a
small part of loading it.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, get_args

from ds_native import _ext
from ds_native._simd import requested_simd_code
from ds_native.api import Crc32Simd

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

SIMD_ENV = "DS_NATIVE_CRC32_SIMD"
"""Environment variable that forces the code path of every ``crc32`` call (unless ``simd=``)."""

_SIMD_CODES: dict[Crc32Simd, int] = {"scalar": 1, "pclmul": 2, "vpclmul": 3}
_SIMD_NAMES: dict[int, Crc32Simd] = {code: name for name, code in _SIMD_CODES.items()}
_SCALAR = _SIMD_CODES["scalar"]


def crc32(data: Buffer, value: int = 0, *, simd: Crc32Simd | None = None) -> int:
    """CRC-32 of ``data`` continuing from ``value``: exactly ``zlib.crc32(data, value)``.

    Args:
        data: Any C-contiguous buffer (bytes, bytearray, memoryview of an mmap or of a numpy
            array); read in place, without a copy, with the GIL released.
        value: The CRC of the bytes before ``data`` (0 to start); like zlib, only its low 32
            bits count.
        simd: Force the code path (``"vpclmul"``, ``"pclmul"`` or ``"scalar"``); None uses
            ``$DS_NATIVE_CRC32_SIMD`` when set, else the widest the CPU supports.

    Returns:
        The unsigned 32-bit CRC. Without the C extension, or on a CPU without PCLMULQDQ (unless
        ``simd="scalar"`` is forced), computed by ``zlib.crc32``, whose loop is the faster there.

    Example:
        >>> ds_native.crc32(b"hello") == zlib.crc32(b"hello")
        True
    """
    code = native_code(simd)
    value &= 0xFFFFFFFF
    if code is None:
        return zlib.crc32(data, value)
    lib = _ext.EXTENSION.lib
    ffi = _ext.EXTENSION.ffi
    try:
        view = ffi.from_buffer(data)
    except TypeError as exc:
        raise TypeError(
            f"crc32: data must support the buffer protocol, got {type(data).__name__}"
        ) from exc
    with view:  # drops the buffer export now, so the caller may close an mmap right after
        return int(lib.ds_native_crc32(value, view, len(view), code))


def crc32_spans(
    data: Buffer,
    spans: Sequence[tuple[int, int]],
    *,
    chained: bool = False,
    simd: Crc32Simd | None = None,
) -> list[int]:
    """The CRC-32 of each ``(start, length)`` span of ``data``, in one call that releases the
    GIL once: what many :func:`crc32` calls give, without taking the GIL back between spans
    (a thread hashing many tensors of a mapped file beside a Python loader would otherwise
    wait for it once per span).

    Args:
        data: Any C-contiguous buffer, read in place (e.g. a memoryview of an mmap).
        spans: ``(start, length)`` byte ranges of ``data``, in any order.
        chained: each span's CRC continues from the previous one's, so the last value is the
            CRC-32 of the spans one after another (``zlib.crc32`` of their concatenation).
        simd: as for :func:`crc32`.

    Returns:
        One unsigned 32-bit CRC per span.

    Raises:
        ValueError: a span with a negative start or length, or one that leaves ``data``.

    Example:
        >>> ds_native.crc32_spans(b"hello world", [(0, 5), (6, 5)])
        [907060870, 980881731]
    """
    view = memoryview(data).cast("B")
    with view:
        starts, lengths = checked_spans("crc32_spans", spans, view.nbytes)
        code = native_code(simd)
        if not spans:
            return []
        if code is None:
            out, value = [], 0
            for a, n in zip(starts, lengths):
                value = zlib.crc32(view[a : a + n], value if chained else 0)
                out.append(value)
            return out
        kernel = _ext.EXTENSION.lib.ds_native_crc32_spans
        return native_span_crcs(kernel, view, starts, lengths, int(chained), code)


def native_span_crcs(
    kernel: Any, view: memoryview, starts: list[int], lengths: list[int], *args: Any
) -> list[int]:
    """Run a C kernel over spans of ``view`` (checked by :func:`checked_spans`):
    ``kernel(source, size, starts, lengths, count, *args, crcs)`` (``ds_native_crc32_spans``'s
    calling convention); the CRC-32 it wrote per span."""
    ffi = _ext.EXTENSION.ffi
    count = len(starts)
    crcs = ffi.new("uint32_t[]", count)
    with ffi.from_buffer(view) as source:
        status = kernel(
            source,
            view.nbytes,
            ffi.new("uint64_t[]", starts),
            ffi.new("uint64_t[]", lengths),
            count,
            *args,
            crcs,
        )
    assert status == 0  # the spans were checked
    return list(crcs)


def checked_spans(
    caller: str, spans: Sequence[tuple[int, int]], size: int
) -> tuple[list[int], list[int]]:
    """The starts and lengths of ``spans``, each checked to lie within ``size`` bytes (a
    ValueError naming ``caller`` and the first span that does not)."""
    starts = [int(a) for a, _ in spans]
    lengths = [int(n) for _, n in spans]
    bad = [(a, n) for a, n in zip(starts, lengths) if a < 0 or n < 0 or a + n > size]
    if bad:
        raise ValueError(f"{caller}: span (start, length) {bad[0]} leaves the {size}-byte buffer")
    return starts, lengths


def native_code(simd: Crc32Simd | None) -> int | None:
    """The C code path to request (0: the kernel picks), or None where zlib runs instead: no
    C extension, or a CPU whose default would be the slice-by-8 fallback, which zlib's own loop
    beats ("scalar" runs only when forced)."""
    lib = _ext.EXTENSION.lib
    code = _simd_code(simd)
    if lib is None or (code == 0 and lib.ds_native_crc32_auto_simd() == _SCALAR):
        return None
    return code


def default_crc32_simd() -> Crc32Simd | None:
    """The widest code path :func:`crc32` runs here by default (None without the C extension);
    without a forced path, buffers under 4 KiB take ``"pclmul"`` instead of ``"vpclmul"``."""
    lib = _ext.EXTENSION.lib
    if lib is None:
        return None
    return _SIMD_NAMES[_simd_code(None) or lib.ds_native_crc32_auto_simd()]


def crc32_simd_supported(simd: Crc32Simd) -> bool:
    """Whether this CPU (and build) can run the ``simd`` code path of :func:`crc32`."""
    lib = _ext.EXTENSION.lib
    return lib is not None and bool(lib.ds_native_crc32_simd_supported(_SIMD_CODES[simd]))


def _simd_code(simd: Crc32Simd | None) -> int:
    """The C code for the requested path (0: let the kernel pick); raises if it cannot run."""
    lib = _ext.EXTENSION.lib
    return requested_simd_code(
        "crc32",
        simd,
        SIMD_ENV,
        _SIMD_CODES,
        get_args(Crc32Simd),
        None if lib is None else lib.ds_native_crc32_simd_supported,
        None if lib is None else lib.ds_native_crc32_auto_simd,
    )
