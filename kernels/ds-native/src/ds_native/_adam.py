"""CPU Adam: one in-place Adam/AdamW step over fp32 master parameters (``csrc/adam.c``).

The C kernel reads param, grad, exp_avg and exp_avg_sq once and writes param, exp_avg and
exp_avg_sq once (28 bytes per parameter), optionally writing the new parameters to a float16 or
bfloat16 copy in the same pass (ZeRO-Offload's copy back to the low-precision model). It runs
AVX-512, AVX2 or portable code, picked from the CPU at run time, on up to ``num_threads``
threads; see [Note: CPU-Adam code paths] in ``csrc/adam.c``.
"""

from __future__ import annotations

import math
from typing import NamedTuple, get_args

import torch

from ds_native import _ext
from ds_native._dispatch import choose_backend, native_mismatch
from ds_native._simd import requested_simd_code
from ds_native.api import AdamSimd, Backend

SIMD_ENV = "DS_NATIVE_ADAM_SIMD"
"""Environment variable that forces the code path of every ``adam_step`` call (unless ``simd=``)."""

_SIMD_CODES: dict[AdamSimd, int] = {"scalar": 1, "avx2": 2, "avx512": 3}
_SIMD_NAMES: dict[int, AdamSimd] = {code: name for name, code in _SIMD_CODES.items()}
_STATE_DTYPES = frozenset({torch.float32})
_HALF_DTYPES = frozenset({torch.float16, torch.bfloat16})
_GRAD_DTYPES = _STATE_DTYPES | _HALF_DTYPES
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


class _Hyper(NamedTuple):
    """One call's step number and hyperparameters, as the implementations take them."""

    step: int
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float
    adamw_mode: bool
    bias_correction: bool


def adam_step_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    param_copy: torch.Tensor | None = None,
) -> None:
    """Torch reference for :func:`adam_step`, for tensors of any floating dtype and device.

    Computes in float32 and writes the results back in each tensor's own dtype.
    """
    _check_args(param, grad, exp_avg, exp_avg_sq, param_copy, step)
    hyper = _Hyper(step, lr, betas, eps, weight_decay, adamw_mode, bias_correction)
    _reference(param, grad, exp_avg, exp_avg_sq, param_copy, hyper)


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw_mode: bool = True,
    bias_correction: bool = True,
    param_copy: torch.Tensor | None = None,
    num_threads: int | None = None,
    simd: AdamSimd | None = None,
    backend: Backend | None = None,
) -> AdamSimd | Backend:
    """One Adam (or AdamW) step, in place, the update of ``torch.optim.Adam``/``AdamW``.

    The C kernel runs on contiguous CPU tensors outside autograd with float32 ``param``,
    ``exp_avg`` and ``exp_avg_sq``, and a float32, float16 or bfloat16 ``grad``; anything else runs
    :func:`adam_step_reference`. No two of the tensors may share memory.

    Args:
        param: Parameters, updated in place.
        grad: Gradient, same shape as ``param``.
        exp_avg: First moment, updated in place.
        exp_avg_sq: Second moment, updated in place.
        step: This step's number, counting from 1 (for the bias correction).
        lr: Learning rate.
        betas: Decay rates of the first and second moments.
        eps: Added to the denominator.
        weight_decay: Weight decay factor.
        adamw_mode: Decoupled weight decay (AdamW) when True; L2 (added to the gradient) when
            False.
        bias_correction: Divide the moments by ``1 - beta ** step``.
        param_copy: Optional float16 or bfloat16 tensor of ``param``'s shape that receives the
            updated parameters (rounded to nearest even) in the same pass.
        num_threads: Threads for the C kernel; None uses ``torch.get_num_threads()``.
        simd: Force the C kernel's code path (``"avx512"``, ``"avx2"`` or ``"scalar"``); None
            uses ``$DS_NATIVE_ADAM_SIMD`` when set, else the widest the CPU supports.
        backend: ``"native"`` or ``"torch"`` to force an implementation (``"native"`` raises
            when the C kernel cannot run); None to choose automatically.

    Returns:
        What ran: the C kernel's code path, or ``"torch"`` for the reference.

    Raises:
        ValueError: Shapes or devices differ, tensors share memory, ``step < 1``, or the forced
            backend or code path cannot run here.
        TypeError: ``step`` is not an int, or ``param_copy`` is not float16/bfloat16.

    Example:
        >>> p, g = torch.ones(4), torch.full((4,), 0.5)
        >>> m, v = torch.zeros(4), torch.zeros(4)
        >>> ds_native.adam_step(p, g, m, v, step=1, lr=0.1)
        'avx512'
        >>> p
        tensor([0.9000, 0.9000, 0.9000, 0.9000])
    """
    _check_args(param, grad, exp_avg, exp_avg_sq, param_copy, step)
    hyper = _Hyper(step, lr, betas, eps, weight_decay, adamw_mode, bias_correction)
    tensors = (param, grad, exp_avg, exp_avg_sq) + (() if param_copy is None else (param_copy,))
    if (
        _state_rules_out_native(param, exp_avg, exp_avg_sq, backend)
        or choose_backend("adam_step", tensors, _GRAD_DTYPES, backend) == "torch"
    ):
        _reference(param, grad, exp_avg, exp_avg_sq, param_copy, hyper)
        return "torch"
    threads = torch.get_num_threads() if num_threads is None else num_threads
    return _native(
        param, grad, exp_avg, exp_avg_sq, param_copy, hyper, _simd_code(simd), max(1, threads)
    )


def default_simd() -> AdamSimd | None:
    """The code path :func:`adam_step` runs by default here (None without the C extension)."""
    if _ext.EXTENSION.lib is None:
        return None
    return _SIMD_NAMES[_simd_code(None) or _ext.EXTENSION.lib.ds_native_adam_auto_simd()]


def _simd_code(simd: AdamSimd | None) -> int:
    """The C code for the requested path (0: let the kernel pick); raises if it cannot run."""
    lib = _ext.EXTENSION.lib
    return requested_simd_code(
        "adam_step",
        simd,
        SIMD_ENV,
        _SIMD_CODES,
        get_args(AdamSimd),
        None if lib is None else lib.ds_native_adam_simd_supported,
        None if lib is None else lib.ds_native_adam_auto_simd,
    )


def _state_rules_out_native(
    param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, backend: Backend | None
) -> bool:
    """Whether param/state that the kernel cannot take send an automatic call to the reference.

    The kernel keeps float32 master weights and state while grad and copy may be 16-bit, so the
    state's dtype is checked here; the rest (device, layout, autograd, a missing build) is
    ``choose_backend``'s.
    """
    mismatch = native_mismatch((param, exp_avg, exp_avg_sq), _STATE_DTYPES)
    if mismatch is not None and backend == "native":
        raise ValueError(f"adam_step(backend='native'): the C kernel {mismatch} for param/state")
    return mismatch is not None and backend is None


def _reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_copy: torch.Tensor | None,
    hyper: _Hyper,
) -> None:
    # Same operations in the same order as the C kernel ([Note: CPU-Adam code paths]).
    (beta1, beta2), lr, weight_decay = hyper.betas, hyper.lr, hyper.weight_decay
    bc1, bc2 = 1.0, 1.0
    if hyper.bias_correction:
        bc1, bc2 = 1.0 - beta1**hyper.step, 1.0 - beta2**hyper.step
    # .float() is the tensor itself when it is already float32, so those update in place.
    p, m, v = param.float(), exp_avg.float(), exp_avg_sq.float()
    g = grad.float()
    if weight_decay != 0 and not hyper.adamw_mode:
        g = g.add(p, alpha=weight_decay)
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = v.sqrt().mul_(1 / math.sqrt(bc2)).add_(hyper.eps)
    if weight_decay != 0 and hyper.adamw_mode:
        p.mul_(1 - lr * weight_decay)
    p.addcdiv_(m, denom, value=-lr / bc1)
    for out, result in ((param, p), (exp_avg, m), (exp_avg_sq, v)):
        if out is not result:
            out.copy_(result)
    if param_copy is not None:
        param_copy.copy_(p)


def _native(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_copy: torch.Tensor | None,
    hyper: _Hyper,
    simd_code: int,
    num_threads: int,
) -> AdamSimd:
    ffi, lib = _ext.EXTENSION.ffi, _ext.EXTENSION.lib
    fields = {**hyper._asdict(), "beta1": hyper.betas[0], "beta2": hyper.betas[1]}
    del fields["betas"]
    hparams = ffi.new("ds_native_adam_hparams *", fields)
    copy_ptr = ffi.NULL if param_copy is None else ffi.cast("void *", param_copy.data_ptr())
    copy_dtype = -1 if param_copy is None else _DTYPE_CODES[param_copy.dtype]
    ran = lib.ds_native_adam_step(
        param.numel(),
        ffi.cast("float *", param.data_ptr()),
        ffi.cast("void *", grad.data_ptr()),
        _DTYPE_CODES[grad.dtype],
        ffi.cast("float *", exp_avg.data_ptr()),
        ffi.cast("float *", exp_avg_sq.data_ptr()),
        copy_ptr,
        copy_dtype,
        hparams,
        simd_code,
        num_threads,
    )
    if ran < 0:  # _check_args and _simd_code rule these out; reaching here is a bug
        raise RuntimeError(f"adam_step: the C kernel rejected its arguments (code {ran})")
    # Written behind autograd's back: bump the versions so a graph that saved them notices.
    for t in (param, exp_avg, exp_avg_sq, param_copy):
        if t is not None:
            torch.autograd.graph.increment_version(t)
    return _SIMD_NAMES[ran]


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The byte range ``t`` can touch (conservative for strided tensors)."""
    if t.numel() == 0:
        return 0, 0
    itemsize = t.element_size()
    low = high = t.data_ptr()
    for size, stride in zip(t.shape, t.stride()):
        reach = (size - 1) * stride * itemsize
        if reach < 0:
            low += reach
        else:
            high += reach
    return low, high + itemsize


def _check_args(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    param_copy: torch.Tensor | None,
    step: int,
) -> None:
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"adam_step: step must be an int, got {type(step).__name__}")
    if step < 1:
        raise ValueError(f"adam_step: step counts from 1, got step={step}")
    named = {"param": param, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if param_copy is not None:
        if param_copy.dtype not in _HALF_DTYPES:
            raise TypeError(
                f"adam_step: param_copy must be float16 or bfloat16, got {param_copy.dtype}"
            )
        named["param_copy"] = param_copy
    check_adam_buffers("adam_step", named)


def check_adam_buffers(op: str, named: dict[str, torch.Tensor]) -> None:
    """Raises unless the tensors all have the first one's shape and device and share no memory.

    ``named`` maps argument names (for the message) to tensors, the param first.
    """
    (first, param), *others = named.items()
    for name, t in others:
        if t.shape != param.shape:
            raise ValueError(
                f"{op}: {name} must have {first}'s shape {tuple(param.shape)}, got {tuple(t.shape)}"
            )
        if t.device != param.device:
            raise ValueError(
                f"{op}: {name} must be on {first}'s device {param.device}, got {t.device}"
            )
    if param.device.type == "meta":
        return
    extents = {name: _extent(t) for name, t in named.items()}
    names = list(extents)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            (a0, a1), (b0, b1) = extents[a], extents[b]
            if a0 < b1 and b0 < a1:
                raise ValueError(f"{op}: {a} and {b} share memory; pass separate tensors")
