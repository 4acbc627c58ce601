"""Blockwise int8/int4 quantization, the wire format of ZeRO++'s qwZ and qgZ.

The flattened input is cut into blocks of ``block_size`` elements, and each block is scaled by
its own absolute maximum (symmetric, no zero point): ``scale = absmax / qmax`` with ``qmax`` 127
for int8 and 7 for int4, and ``q = round_half_even(x / scale)``, so every value dequantizes
within ``scale / 2`` of itself. DeepSpeed's ZeRO++ quantizer groups the same way (one float
scale per group); its codes span ``[-2**(b-1), 2**(b-1) - 1]`` and clamp the maximum, whereas
these stay in ``[-qmax, qmax]`` so the error bound holds for the maximum too.

Layout: ``q`` is flat and padded to whole blocks (the last block is zero-padded, which leaves its
scale alone): int8 holds one code per byte; int4 packs two codes per uint8, element ``2i`` in the
low nibble and ``2i + 1`` in the high nibble, each a 4-bit two's complement. ``scales`` is float32,
one per block. A block holding NaN or +-inf gets a NaN scale and zero codes, so it dequantizes
to NaN throughout and overflow checks after the collective still see it. An all-zero block gets
scale 0 and zero codes.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ds_kernels._dispatch import choose_backend
from ds_kernels._triton import jit, tl
from ds_kernels.api import Backend

_FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
_QMAX = {8: 127, 4: 7}
_MAX_BLOCK = 1 << 16


class QuantizedBlocks(NamedTuple):
    """What :func:`quantize_blockwise` returns; unpacks as ``q, scales``."""

    q: torch.Tensor
    """Flat codes padded to whole blocks: int8 (bits=8) or two int4 codes per uint8 (bits=4)."""
    scales: torch.Tensor
    """float32, one per block: a block dequantizes as ``code * scale``."""


@jit
def _quantize_kernel(
    x_ptr, q_ptr, scale_ptr, n_elements, QMAX: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr
):
    block = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = BLOCK // 2
    # Even and odd elements apart: int4 packs each pair into one byte.
    offs = block * BLOCK + 2 * tl.arange(0, HALF)
    even = tl.load(x_ptr + offs, mask=offs < n_elements, other=0.0).to(tl.float32)
    odd = tl.load(x_ptr + offs + 1, mask=offs + 1 < n_elements, other=0.0).to(tl.float32)
    bad_even = (even != even) | (tl.abs(even) == float("inf"))
    bad_odd = (odd != odd) | (tl.abs(odd) == float("inf"))
    any_bad = (
        tl.maximum(tl.max(bad_even.to(tl.int32), axis=0), tl.max(bad_odd.to(tl.int32), axis=0)) > 0
    )
    absmax = tl.maximum(
        tl.max(tl.where(bad_even, 0.0, tl.abs(even)), axis=0),
        tl.max(tl.where(bad_odd, 0.0, tl.abs(odd)), axis=0),
    )
    scale = tl.div_rn(absmax, QMAX * 1.0)
    scale = tl.where(any_bad, float("nan"), scale)
    usable = (~any_bad) & (absmax > 0.0)
    safe = tl.where(usable, scale, 1.0)
    even = tl.where(bad_even, 0.0, even)
    odd = tl.where(bad_odd, 0.0, odd)
    q_even = tl.where(usable, _round_half_even(tl.div_rn(even, safe)), 0.0)
    q_odd = tl.where(usable, _round_half_even(tl.div_rn(odd, safe)), 0.0)
    q_even = tl.minimum(tl.maximum(q_even, -QMAX * 1.0), QMAX * 1.0).to(tl.int32)
    q_odd = tl.minimum(tl.maximum(q_odd, -QMAX * 1.0), QMAX * 1.0).to(tl.int32)
    tl.store(scale_ptr + block, scale)
    if BITS == 8:
        tl.store(q_ptr + offs, q_even.to(tl.int8))
        tl.store(q_ptr + offs + 1, q_odd.to(tl.int8))
    else:
        packed = (q_even & 0xF) | ((q_odd & 0xF) << 4)
        tl.store(q_ptr + block * HALF + tl.arange(0, HALF), packed.to(tl.uint8))


@jit
def _round_half_even(v):
    # floor and an exact remainder, so ties go to even as torch.round does.
    r = tl.floor(v)
    frac = v - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, r + 1.0, r)


@jit
def _dequantize_kernel(
    q_ptr, scale_ptr, out_ptr, n_elements, BITS: tl.constexpr, BLOCK: tl.constexpr
):
    block = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = BLOCK // 2
    offs = block * BLOCK + 2 * tl.arange(0, HALF)
    scale = tl.load(scale_ptr + block)
    if BITS == 8:
        q_even = tl.load(q_ptr + offs).to(tl.float32)
        q_odd = tl.load(q_ptr + offs + 1).to(tl.float32)
    else:
        packed = tl.load(q_ptr + block * HALF + tl.arange(0, HALF)).to(tl.int32)
        lo = packed & 0xF
        hi = (packed >> 4) & 0xF
        q_even = tl.where(lo >= 8, lo - 16, lo).to(tl.float32)
        q_odd = tl.where(hi >= 8, hi - 16, hi).to(tl.float32)
    ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + offs, (q_even * scale).to(ty), mask=offs < n_elements)
    tl.store(out_ptr + offs + 1, (q_odd * scale).to(ty), mask=offs + 1 < n_elements)


def quantize_blockwise_reference(
    x: torch.Tensor, *, bits: int = 8, block_size: int = 256
) -> QuantizedBlocks:
    """Torch reference for :func:`quantize_blockwise` (same layout, same bytes)."""
    qmax = _QMAX[bits]
    n = x.numel()
    n_blocks = -(-n // block_size)
    flat = torch.zeros(n_blocks * block_size, dtype=torch.float32, device=x.device)
    flat[:n] = x.reshape(-1).to(torch.float32)
    blocks = flat.view(n_blocks, block_size)
    bad = ~torch.isfinite(blocks)
    block_bad = bad.any(dim=1, keepdim=True)
    absmax = torch.where(bad, 0.0, blocks.abs()).amax(dim=1, keepdim=True)
    scale = absmax / qmax
    usable = ~block_bad & (absmax > 0)
    safe = torch.where(usable, scale, torch.ones_like(scale))
    blocks = torch.where(bad, 0.0, blocks)
    q = torch.where(usable, torch.round(blocks / safe), 0.0).clamp_(-qmax, qmax).to(torch.int32)
    scales = torch.where(block_bad, float("nan"), scale).reshape(-1)
    if bits == 8:
        return QuantizedBlocks(q.reshape(-1).to(torch.int8), scales)
    pairs = q.reshape(-1, 2)
    packed = (pairs[:, 0] & 0xF) | ((pairs[:, 1] & 0xF) << 4)
    return QuantizedBlocks(packed.to(torch.uint8), scales)


def dequantize_blockwise_reference(
    q: torch.Tensor,
    scales: torch.Tensor,
    *,
    bits: int = 8,
    block_size: int = 256,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Torch reference for :func:`dequantize_blockwise`."""
    if bits == 8:
        codes = q.to(torch.float32)
    else:
        packed = q.to(torch.int32)
        nibbles = torch.stack((packed & 0xF, (packed >> 4) & 0xF), dim=1).reshape(-1)
        codes = torch.where(nibbles >= 8, nibbles - 16, nibbles).to(torch.float32)
    out = (codes.reshape(-1, block_size) * scales.reshape(-1, 1)).reshape(-1)
    numel, out_shape = _out_shape(shape, out.numel(), block_size)
    return out[:numel].to(dtype).reshape(out_shape)


def quantize_blockwise(
    x: torch.Tensor,
    *,
    bits: int = 8,
    block_size: int = 256,
    symmetric: bool = True,
    backend: Backend | None = None,
) -> QuantizedBlocks:
    """Quantizes ``x`` to int8 or int4 codes with one float32 scale per block.

    The wire format of ZeRO++: qwZ all-gathers int8 weights and qgZ reduces int4/int8 gradients.
    Any length is taken: the flattened input is zero-padded to whole blocks (see the module
    docstring for the layout and for NaN/inf). The Triton kernel runs on contiguous
    float32/float16/bfloat16 CUDA tensors outside autograd; everything else runs
    :func:`quantize_blockwise_reference`, which gives the same bytes.

    Args:
        x: float32, float16 or bfloat16 tensor of any shape (read flattened).
        bits: 8 (int8 codes) or 4 (two int4 codes per uint8 byte).
        block_size: Elements per scale: a power of two from 2 to 65536.
        symmetric: Must be True (absmax scaling, no zero point); asymmetric is not implemented.
        backend: ``"triton"`` or ``"torch"`` to force an implementation; None chooses.

    Returns:
        ``(q, scales)``: ``q`` int8 of ``ceil(n / block_size) * block_size`` codes (uint8 of half
        as many bytes for int4), ``scales`` float32 of ``ceil(n / block_size)``.

    Raises:
        ValueError: Bad ``bits``, ``block_size`` or ``symmetric``, or ``backend="triton"`` that
            cannot take ``x``.
        TypeError: ``x`` is not a float16/bfloat16/float32 tensor.

    Example:
        >>> ds_kernels.quantize_blockwise(torch.tensor([1.0, -0.5]), block_size=2)
        QuantizedBlocks(q=tensor([127, -64], dtype=torch.int8), scales=tensor([0.0079]))
    """
    _check_format("quantize_blockwise", bits, block_size)
    if symmetric is not True:
        raise ValueError(
            "quantize_blockwise: symmetric=False (asymmetric, zero-point quantization) is not "
            "implemented; pass symmetric=True"
        )
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOAT_DTYPES:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(
            f"quantize_blockwise: x must be a float32, float16 or bfloat16 tensor, got {got}"
        )
    kernel = _quantize_kernel
    if choose_backend("quantize_blockwise", kernel, (x,), _FLOAT_DTYPES, backend) == "torch":
        return quantize_blockwise_reference(x, bits=bits, block_size=block_size)
    n = x.numel()
    n_blocks = -(-n // block_size)
    q_len = n_blocks * block_size // (8 // bits)
    q = torch.empty(q_len, dtype=torch.int8 if bits == 8 else torch.uint8, device=x.device)
    scales = torch.empty(n_blocks, dtype=torch.float32, device=x.device)
    if n_blocks:
        with _on_device(x):
            kernel[(n_blocks,)](x, q, scales, n, QMAX=_QMAX[bits], BITS=bits, BLOCK=block_size)
    return QuantizedBlocks(q, scales)


def dequantize_blockwise(
    q: torch.Tensor,
    scales: torch.Tensor,
    *,
    bits: int = 8,
    block_size: int = 256,
    shape: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Rebuilds a tensor from :func:`quantize_blockwise`'s codes and scales.

    Args:
        q: The codes (int8 for bits=8, packed uint8 for bits=4), padded to whole blocks.
        scales: float32, one per block.
        bits: 8 or 4, as quantized.
        block_size: As quantized.
        shape: Shape of the original tensor, which drops the padding; None returns all the
            padded elements, flat.
        dtype: float32, float16 or bfloat16 result (computed in float32, rounded once).
        backend: ``"triton"`` or ``"torch"`` to force an implementation; None chooses.

    Returns:
        A new tensor of ``shape`` and ``dtype`` on ``q``'s device.

    Raises:
        ValueError: Sizes, devices or format arguments do not agree.
        TypeError: Wrong dtypes of ``q``, ``scales`` or ``dtype``.
    """
    _check_format("dequantize_blockwise", bits, block_size)
    _check_codes(q, scales, bits, block_size, dtype)
    n_blocks = scales.numel()
    numel, out_shape = _out_shape(shape, n_blocks * block_size, block_size)
    kernel = _dequantize_kernel
    allowed = frozenset({q.dtype, torch.float32})
    op = "dequantize_blockwise"
    if choose_backend(op, kernel, (q, scales), allowed, backend) == "torch":
        return dequantize_blockwise_reference(
            q, scales, bits=bits, block_size=block_size, shape=out_shape, dtype=dtype
        )
    out = torch.empty(numel, dtype=dtype, device=q.device)
    if numel:
        with _on_device(q):
            kernel[(n_blocks,)](q, scales, out, numel, BITS=bits, BLOCK=block_size)
    return out.reshape(out_shape)


def quantized_nbytes(numel: int, *, bits: int = 8, block_size: int = 256) -> int:
    """Bytes on the wire for ``numel`` elements quantized this way (codes plus float32 scales)."""
    _check_format("quantized_nbytes", bits, block_size)
    n_blocks = -(-numel // block_size)
    return n_blocks * block_size * bits // 8 + 4 * n_blocks


def _on_device(t: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    # Triton launches on the current CUDA device, which need not be the tensor's device.
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _check_format(op: str, bits: int, block_size: int) -> None:
    if isinstance(bits, bool) or bits not in _QMAX:
        raise ValueError(f"{op}: bits must be 8 or 4, got {bits!r}")
    ok = (
        isinstance(block_size, int)
        and not isinstance(block_size, bool)
        and 2 <= block_size <= _MAX_BLOCK
        and block_size & (block_size - 1) == 0
    )
    if not ok:
        raise ValueError(
            f"{op}: block_size must be a power of two from 2 to {_MAX_BLOCK}, got {block_size!r}"
        )


def _check_codes(
    q: torch.Tensor, scales: torch.Tensor, bits: int, block_size: int, dtype: torch.dtype
) -> None:
    want = torch.int8 if bits == 8 else torch.uint8
    if q.dtype != want:
        raise TypeError(f"dequantize_blockwise: bits={bits} needs {want} codes, got {q.dtype}")
    if scales.dtype != torch.float32:
        raise TypeError(f"dequantize_blockwise: scales must be float32, got {scales.dtype}")
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"dequantize_blockwise: dtype must be float32, float16 or bfloat16, got {dtype}"
        )
    if q.device != scales.device:
        raise ValueError(
            f"dequantize_blockwise: q and scales must be on one device, got {q.device} and "
            f"{scales.device}"
        )
    expected = scales.numel() * block_size * bits // 8
    if q.numel() != expected:
        raise ValueError(
            f"dequantize_blockwise: {scales.numel()} scales of block_size={block_size} at "
            f"bits={bits} need {expected} code bytes, got {q.numel()}"
        )


def _out_shape(
    shape: Sequence[int] | None, padded: int, block_size: int
) -> tuple[int, tuple[int, ...]]:
    if shape is None:
        return padded, (padded,)
    out_shape = tuple(int(s) for s in shape)
    numel = math.prod(out_shape)
    if not padded - block_size < numel <= padded and not numel == padded == 0:
        raise ValueError(
            f"dequantize_blockwise: shape={out_shape} holds {numel} elements, but codes of "
            f"{padded} elements in blocks of {block_size} were quantized from "
            f"{max(padded - block_size + 1, 0)} to {padded} elements"
        )
    return numel, out_shape
