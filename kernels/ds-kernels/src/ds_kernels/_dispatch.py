"""The rule every ds_kernels dispatcher applies to pick the Triton kernel or the torch reference."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from ds_kernels import _triton
from ds_kernels.api import Backend


def triton_mismatch(
    kernel: object, tensors: Sequence[torch.Tensor], dtypes: Collection[torch.dtype]
) -> str | None:
    """Why the Triton kernel cannot take these tensors, or None when it can.

    Triton kernels take flat contiguous memory on the GPU (or on the CPU under the interpreter)
    and record no autograd.
    """
    cpu_ok = _triton.is_interpreted(kernel)
    for t in tensors:
        if not (t.is_cuda or (cpu_ok and t.device.type == "cpu")):
            where = "CUDA tensors (or CPU tensors with TRITON_INTERPRET=1)"
            return f"needs {where}, got a tensor on {t.device}"
        if t.dtype not in dtypes:
            names = ", ".join(sorted(str(d) for d in dtypes))
            return f"needs {names} tensors, got {t.dtype}"
        if not t.is_contiguous():
            return "needs contiguous tensors"
        if t.requires_grad and torch.is_grad_enabled():
            return "does not record autograd; call it under torch.no_grad()"
    return None


def choose_backend(
    op: str,
    kernel: object,
    tensors: Sequence[torch.Tensor],
    dtypes: Collection[torch.dtype],
    backend: Backend | None,
) -> Backend:
    """Picks the implementation for one call of kernel ``op``.

    ``None`` picks Triton for CUDA tensors it can take when Triton imported, and the torch
    reference otherwise (CPU tensors always get the reference). ``"triton"`` insists and raises
    when it cannot run, and is how tests reach the interpreter on CPU; ``"torch"`` always picks
    the reference.
    """
    if backend == "torch":
        return "torch"
    if backend not in (None, "triton"):
        raise ValueError(f"{op}: backend must be 'triton', 'torch' or None, got {backend!r}")
    missing = _triton.unavailable_reason()
    if backend == "triton":
        if missing is not None:
            raise RuntimeError(f"{op}(backend='triton'): {missing}")
        mismatch = triton_mismatch(kernel, tensors, dtypes)
        if mismatch is not None:
            raise ValueError(f"{op}(backend='triton'): the Triton kernel {mismatch}")
        return "triton"
    on_cuda = all(t.is_cuda for t in tensors)
    if missing is None and on_cuda and triton_mismatch(kernel, tensors, dtypes) is None:
        return "triton"
    return "torch"
