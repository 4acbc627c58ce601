"""axpy (``y += alpha * x`` in place): the template for a ds_native kernel.

A kernel module holds the torch reference, the call into C (``csrc/<kernel>.c``), and the public
dispatcher that validates arguments and picks between them through ``choose_backend``.
"""

from __future__ import annotations

import torch

from ds_native import _ext
from ds_native._dispatch import choose_backend, partially_overlap
from ds_native.api import Backend

_NATIVE_DTYPES = frozenset({torch.float32})


def axpy_reference(alpha: float, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Torch reference for :func:`axpy`: ``y += alpha * x`` in place; returns ``y``."""
    return y.add_(x, alpha=alpha)


def axpy(
    alpha: float, x: torch.Tensor, y: torch.Tensor, *, backend: Backend | None = None
) -> torch.Tensor:
    """Computes ``y += alpha * x`` in place and returns ``y``.

    The C kernel runs on contiguous float32 CPU tensors outside autograd. Everything else (other
    dtypes, non-contiguous or CUDA tensors, tensors that need grad, or no C extension) runs
    :func:`axpy_reference`.

    Args:
        alpha: Scale applied to ``x``.
        x: Input tensor, same shape, dtype and device as ``y``.
        y: Tensor updated in place.
        backend: ``"native"`` or ``"torch"`` to force an implementation (``"native"`` raises
            when the C kernel cannot run); None to choose automatically.

    Returns:
        ``y``.

    Raises:
        ValueError: Shapes or devices differ, or ``backend="native"`` cannot run.
        TypeError: ``alpha`` is not a real number, or the dtypes differ.

    Example:
        >>> y = torch.ones(3)
        >>> ds_native.axpy(2.0, torch.arange(3.0), y)
        tensor([1., 3., 5.])
    """
    _check_args(alpha, x, y)
    if choose_backend("axpy", (x, y), _NATIVE_DTYPES, backend) == "torch":
        return axpy_reference(alpha, x, y)
    if partially_overlap(x, y):
        return axpy_reference(alpha, x, y)  # torch raises its usual in-place overlap error
    ffi, lib = _ext.EXTENSION.ffi, _ext.EXTENSION.lib
    lib.ds_native_axpy_f32(
        y.numel(),
        float(alpha),
        ffi.cast("float *", x.data_ptr()),
        ffi.cast("float *", y.data_ptr()),
    )
    # Written behind autograd's back: bump the version so a graph that saved y notices.
    torch.autograd.graph.increment_version(y)
    return y


def _check_args(alpha: float, x: torch.Tensor, y: torch.Tensor) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise TypeError(f"axpy: alpha must be a real number, got {type(alpha).__name__}")
    if x.shape != y.shape:
        raise ValueError(
            f"axpy: x and y must have the same shape, got x.shape={tuple(x.shape)} "
            f"and y.shape={tuple(y.shape)}"
        )
    if x.dtype != y.dtype:
        raise TypeError(f"axpy: x and y must have the same dtype, got {x.dtype} and {y.dtype}")
    if x.device != y.device:
        raise ValueError(f"axpy: x and y must be on the same device, got {x.device} and {y.device}")
