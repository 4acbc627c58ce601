"""Memory-bandwidth yardsticks for the CPU kernels (``csrc/stream.c``).

STREAM's triad (``a = b + scalar * c``), and the triads an Adam step's memory traffic makes
(``x += scalar * grad`` for x in param, exp_avg, exp_avg_sq). ``tools/bench/optim.py`` times
CPU-Adam against both in the same run.
"""

from __future__ import annotations

import torch

from ds_native import _ext
from ds_native._adam import check_adam_buffers
from ds_native._dispatch import choose_backend, partially_overlap
from ds_native.api import Backend

_NATIVE_DTYPES = frozenset({torch.float32})


def stream_triad_reference(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, scalar: float
) -> torch.Tensor:
    """Torch reference for :func:`stream_triad`: ``a = b + scalar * c``; returns ``a``."""
    return torch.add(b, c, alpha=scalar, out=a)


def stream_triad(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    scalar: float,
    *,
    nontemporal: bool = False,
    num_threads: int | None = None,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Computes ``a = b + scalar * c`` (STREAM's triad) in place and returns ``a``.

    The C kernel runs on contiguous float32 CPU tensors outside autograd, on ``num_threads``
    threads (None: ``torch.get_num_threads()``); everything else runs
    :func:`stream_triad_reference`.

    STREAM counts 24 bytes per element. Ordinary stores read each line of ``a`` before
    overwriting it (32 bytes move); ``nontemporal=True`` writes ``a`` with streaming stores (on
    x86), so that the 24 bytes counted are the bytes moved: the raw read+write bandwidth.

    Args:
        a: Output, same shape, dtype and device as ``b`` and ``c``.
        b: First input.
        c: Second input, scaled by ``scalar``.
        scalar: Scale applied to ``c``.
        nontemporal: Streaming stores in the C kernel (ignored by the reference).
        num_threads: Threads for the C kernel.
        backend: ``"native"`` or ``"torch"`` to force an implementation; None to choose.

    Returns:
        ``a``.

    Example:
        >>> a, b, c = torch.empty(3), torch.ones(3), torch.arange(3.0)
        >>> ds_native.stream_triad(a, b, c, 3.0)
        tensor([1., 4., 7.])
    """
    for name, t in (("b", b), ("c", c)):
        if t.shape != a.shape or t.dtype != a.dtype or t.device != a.device:
            raise ValueError(
                f"stream_triad: {name} must match a's shape, dtype and device, got "
                f"{tuple(t.shape)}/{t.dtype}/{t.device} for a's "
                f"{tuple(a.shape)}/{a.dtype}/{a.device}"
            )
    if choose_backend("stream_triad", (a, b, c), _NATIVE_DTYPES, backend) == "torch":
        return stream_triad_reference(a, b, c, scalar)
    if partially_overlap(a, b) or partially_overlap(a, c):
        return stream_triad_reference(a, b, c, scalar)  # torch raises its usual overlap error
    ffi, lib = _ext.EXTENSION.ffi, _ext.EXTENSION.lib
    lib.ds_native_stream_triad(
        a.numel(),
        ffi.cast("float *", a.data_ptr()),
        ffi.cast("float *", b.data_ptr()),
        ffi.cast("float *", c.data_ptr()),
        float(scalar),
        bool(nontemporal),
        max(1, torch.get_num_threads() if num_threads is None else num_threads),
    )
    torch.autograd.graph.increment_version(a)
    return a


def stream_adam_traffic_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    scalar: float,
) -> None:
    """Torch reference for :func:`stream_adam_traffic`."""
    for t in (param, exp_avg, exp_avg_sq):
        t.add_(grad, alpha=scalar)


def stream_adam_traffic(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    scalar: float,
    *,
    num_threads: int | None = None,
    backend: Backend | None = None,
) -> None:
    """Moves the bytes an Adam step moves, with a triad's arithmetic: ``x += scalar * grad``.

    For x in ``param``, ``exp_avg``, ``exp_avg_sq``, in one pass: four arrays read, three written
    in place (28 bytes per float32 element). The C kernel (contiguous float32 CPU tensors) runs
    :func:`adam_step`'s own loops (its widest code path, ``num_threads`` threads) with the Adam
    arithmetic replaced, so it shows how fast the memory lets an Adam step go. Tensors must not
    share memory.

    Args:
        param: Updated in place.
        grad: Read.
        exp_avg: Updated in place.
        exp_avg_sq: Updated in place.
        scalar: Scale applied to ``grad``.
        num_threads: Threads for the C kernel; None uses ``torch.get_num_threads()``.
        backend: ``"native"`` or ``"torch"`` to force an implementation; None to choose.
    """
    named = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    check_adam_buffers("stream_adam_traffic", named)
    tensors = tuple(named.values())
    if choose_backend("stream_adam_traffic", tensors, _NATIVE_DTYPES, backend) == "torch":
        stream_adam_traffic_reference(param, grad, exp_avg, exp_avg_sq, scalar)
        return
    ffi, lib = _ext.EXTENSION.ffi, _ext.EXTENSION.lib
    pointers = [ffi.cast("float *", t.data_ptr()) for t in tensors]
    threads = torch.get_num_threads() if num_threads is None else num_threads
    lib.ds_native_stream_adam_traffic(param.numel(), *pointers, float(scalar), max(1, threads))
    for t in (param, exp_avg, exp_avg_sq):
        torch.autograd.graph.increment_version(t)
