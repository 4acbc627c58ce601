"""The rule every ds_native dispatcher applies to pick the C kernel or the torch reference."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from ds_native import _ext
from ds_native.api import Backend


def native_mismatch(tensors: Sequence[torch.Tensor], dtypes: Collection[torch.dtype]) -> str | None:
    """Why the C kernel cannot take these tensors, or None when it can.

    C kernels see raw pointers: CPU memory, contiguous, a known dtype, and no autograd (they
    cannot record a graph).
    """
    for t in tensors:
        if t.device.type != "cpu":
            return f"needs CPU tensors, got a tensor on {t.device}"
        if t.dtype not in dtypes:
            names = ", ".join(sorted(str(d) for d in dtypes))
            return f"needs {names} tensors, got {t.dtype}"
        if not t.is_contiguous():
            return "needs contiguous tensors"
        if t.requires_grad and torch.is_grad_enabled():
            return "does not record autograd; call it under torch.no_grad()"
    return None


def partially_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share some memory without being the same elements."""
    if a.numel() == 0 or b.numel() == 0 or a.data_ptr() == b.data_ptr():
        return False
    a_end = a.data_ptr() + a.numel() * a.element_size()
    b_end = b.data_ptr() + b.numel() * b.element_size()
    return a.data_ptr() < b_end and b.data_ptr() < a_end


def choose_backend(
    op: str,
    tensors: Sequence[torch.Tensor],
    dtypes: Collection[torch.dtype],
    backend: Backend | None,
) -> Backend:
    """Picks the implementation for one call of kernel ``op``.

    ``None`` picks the C kernel when it applies and is built, else the torch reference (warning
    once when only the missing build stood in the way). ``"native"`` insists and raises when it
    cannot run; ``"torch"`` always picks the reference.
    """
    if backend == "torch":
        return "torch"
    if backend not in (None, "native"):
        raise ValueError(f"{op}: backend must be 'native', 'torch' or None, got {backend!r}")
    mismatch = native_mismatch(tensors, dtypes)
    if backend == "native":
        if mismatch is not None:
            raise ValueError(f"{op}(backend='native'): the C kernel {mismatch}")
        if _ext.EXTENSION.lib is None:
            raise RuntimeError(f"{op}(backend='native'): {_ext.EXTENSION.unavailable_reason}")
        return "native"
    if mismatch is not None:
        return "torch"
    if _ext.EXTENSION.lib is None:
        _ext.warn_fallback(_ext.EXTENSION.unavailable_reason or "C extension unavailable")
        return "torch"
    return "native"
