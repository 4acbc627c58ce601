"""scaled_add (``x + alpha * y``): the template for a ds_kernels kernel.

A kernel module holds the Triton kernel, its torch reference, and the public dispatcher that
validates arguments and picks between them through ``choose_backend``.
"""

from __future__ import annotations

import contextlib

import torch

from ds_kernels._dispatch import choose_backend
from ds_kernels._triton import jit, tl, triton
from ds_kernels.api import Backend

_BLOCK_SIZE = 1024
_TRITON_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


@jit
def _scaled_add_kernel(x_ptr, y_ptr, out_ptr, alpha, n_elements, BLOCK_SIZE: tl.constexpr):
    # int64 offsets: flattened parameter buffers pass 2**31 elements.
    start = tl.program_id(0).to(tl.int64) * BLOCK_SIZE
    offsets = start + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    # Compute in fp32 and round once, as torch does for fp16/bf16 on CUDA.
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    y = tl.load(y_ptr + offsets, mask=mask).to(tl.float32)
    out = x + alpha * y
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


def scaled_add_reference(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    """Torch reference for :func:`scaled_add`: returns ``x + alpha * y``."""
    return torch.add(x, y, alpha=alpha)


def scaled_add(
    x: torch.Tensor, y: torch.Tensor, alpha: float, *, backend: Backend | None = None
) -> torch.Tensor:
    """Returns ``x + alpha * y`` as a new tensor.

    The Triton kernel runs on contiguous float32/float16/bfloat16 CUDA tensors outside autograd
    when Triton imported; everything else runs :func:`scaled_add_reference`.

    Args:
        x: First operand.
        y: Second operand, same shape, dtype and device as ``x``.
        alpha: Scale applied to ``y``.
        backend: ``"triton"`` or ``"torch"`` to force an implementation (``"triton"`` raises
            when the kernel cannot run; on CPU tensors it needs ``TRITON_INTERPRET=1`` set before
            ``ds_kernels`` is imported); None to choose automatically.

    Returns:
        A new tensor with the shape, dtype and device of ``x``.

    Raises:
        ValueError: Shapes or devices differ, or ``backend="triton"`` cannot take the tensors.
        TypeError: ``alpha`` is not a real number, or the dtypes differ.
        RuntimeError: ``backend="triton"`` without Triton.

    Example:
        >>> ds_kernels.scaled_add(torch.ones(3), torch.arange(3.0), 2.0)
        tensor([1., 3., 5.])
    """
    _check_args(x, y, alpha)
    kernel = _scaled_add_kernel
    if choose_backend("scaled_add", kernel, (x, y), _TRITON_DTYPES, backend) == "torch":
        return scaled_add_reference(x, y, alpha)
    return _launch(x, y, float(alpha))


def _launch(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    out = torch.empty_like(x)
    n = x.numel()
    if n == 0:
        return out
    grid = (triton.cdiv(n, _BLOCK_SIZE),)
    # Triton launches on the current CUDA device, which need not be the tensors' device.
    device = torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()
    with device:
        _scaled_add_kernel[grid](x, y, out, alpha, n, BLOCK_SIZE=_BLOCK_SIZE)
    return out


def _check_args(x: torch.Tensor, y: torch.Tensor, alpha: float) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise TypeError(f"scaled_add: alpha must be a real number, got {type(alpha).__name__}")
    if x.shape != y.shape:
        raise ValueError(
            f"scaled_add: x and y must have the same shape, got x.shape={tuple(x.shape)} "
            f"and y.shape={tuple(y.shape)}"
        )
    if x.dtype != y.dtype:
        raise TypeError(
            f"scaled_add: x and y must have the same dtype, got {x.dtype} and {y.dtype}"
        )
    if x.device != y.device:
        raise ValueError(
            f"scaled_add: x and y must be on the same device, got {x.device} and {y.device}"
        )
