"""adam: one Adam/AdamW step over a list of tensors, in place (a multi-tensor kernel).

One Triton launch updates every tensor of a list: the kernel reads the tensors' addresses from a
table and each program takes one chunk of one tensor (see [Note: Multi-tensor launch]). The torch
reference runs the same math with ``torch._foreach_*`` ops, which is also the fast CPU path.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Sequence

import torch

from ds_kernels._dispatch import choose_backend
from ds_kernels._triton import jit, tl
from ds_kernels.api import Backend

_BLOCK_SIZE = 1024
_TRITON_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
_LOW_PRECISION = frozenset({torch.float16, torch.bfloat16})

# DECAY_MODE values of the kernel.
_NO_DECAY, _L2_DECAY, _DECOUPLED_DECAY = 0, 1, 2

# [Note: Multi-tensor launch]
# A model has hundreds of parameter tensors, from biases of a few hundred elements to embeddings
# of tens of millions; one launch per tensor would cost more in launch overhead than the update
# itself. Instead the host writes the four addresses (param, grad, exp_avg, exp_avg_sq) of every
# tensor into one int64 table, and a chunk table maps each program id to (tensor, chunk): program
# ``pid`` updates elements ``[(pid - first_chunk[t]) * BLOCK, ...)`` of tensor ``t = owner[pid]``.
# The chunk tables depend only on the tensor sizes and are cached per device; the address table
# is rebuilt every call because gradients are reallocated by ``zero_grad(set_to_none=True)``.
# Addresses read from memory carry no alignment, so the host passes ALIGNED (every address is
# 16-byte aligned, as the caching allocator's are) and the kernel declares it with
# tl.multiple_of; and a mask on a size read from memory has no known constancy, so only the
# last chunk of a tensor is masked. Both are needed for 128-bit loads (checked in the PTX for
# sm_90). The math is done in fp32 with IEEE-rounded sqrt and division, in torch's order of
# operations, so the kernel matches the reference to a few ulps; a bf16/fp16 param is rounded
# once per step.


@jit
def _adam_kernel(
    addresses_ptr,
    numels_ptr,
    owner_ptr,
    first_chunk_ptr,
    num_tensors,
    param_like_ptr,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    decay,
    step_size,
    bias_correction2_sqrt,
    DECAY_MODE: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(owner_ptr + pid)
    start = (pid - tl.load(first_chunk_ptr + t)).to(tl.int64) * BLOCK_SIZE
    n = tl.load(numels_ptr + t)

    param_type = tl.pointer_type(param_like_ptr.dtype.element_ty)
    state_type = tl.pointer_type(tl.float32)
    p_ptr = tl.load(addresses_ptr + t).to(param_type)
    g_ptr = tl.load(addresses_ptr + num_tensors + t).to(param_type)
    m_ptr = tl.load(addresses_ptr + 2 * num_tensors + t).to(state_type)
    v_ptr = tl.load(addresses_ptr + 3 * num_tensors + t).to(state_type)
    if ALIGNED:  # every address is 16-byte aligned (checked on the host): vector loads
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)

    scalars = (
        one_minus_beta1,
        beta2,
        one_minus_beta2,
        eps,
        decay,
        step_size,
        bias_correction2_sqrt,
    )
    offsets = start + tl.arange(0, BLOCK_SIZE)
    # A mask on a size read from memory stops vectorisation: only the last chunk is masked.
    if start + BLOCK_SIZE <= n:
        _adam_chunk(p_ptr, g_ptr, m_ptr, v_ptr, offsets, n, scalars, DECAY_MODE, False)
    else:
        _adam_chunk(p_ptr, g_ptr, m_ptr, v_ptr, offsets, n, scalars, DECAY_MODE, True)


@jit
def _adam_chunk(
    p_ptr, g_ptr, m_ptr, v_ptr, offsets, n, scalars, DECAY_MODE: tl.constexpr, MASKED: tl.constexpr
):
    one_minus_beta1, beta2, one_minus_beta2, eps, decay, step_size, bc2_sqrt = scalars
    if MASKED:
        mask = offsets < n
    else:
        mask = None
    p = tl.load(p_ptr + offsets, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offsets, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offsets, mask=mask)
    v = tl.load(v_ptr + offsets, mask=mask)

    # decay is weight_decay for L2 (mode 1) and 1 - lr * weight_decay for decoupled (mode 2).
    if DECAY_MODE == 1:
        g = g + decay * p
    if DECAY_MODE == 2:
        p = p * decay
    # 1 - beta arrives rounded from double, as torch rounds its lerp weight and addcmul value:
    # 1 - beta1 taken in fp32 on the device differs by 2e-7 relative and shows in exp_avg.
    m = m + one_minus_beta1 * (g - m)
    v = beta2 * v + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)

    tl.store(m_ptr + offsets, m, mask=mask)
    tl.store(v_ptr + offsets, v, mask=mask)
    tl.store(p_ptr + offsets, p.to(p_ptr.dtype.element_ty), mask=mask)


def adam_reference(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    adam_w_mode: bool = True,
    bias_correction: bool = True,
) -> None:
    """Torch reference for :func:`adam` (``torch._foreach_*`` ops); same arguments, same result.

    fp16/bf16 params are updated through fp32 copies and rounded once at the end.
    """
    if not params:
        return
    params, exp_avgs, exp_avg_sqs = list(params), list(exp_avgs), list(exp_avg_sqs)
    upcast = params[0].dtype in _LOW_PRECISION
    work = [p.float() for p in params] if upcast else params
    grads = [g.float() for g in grads] if upcast else list(grads)
    if weight_decay != 0 and not adam_w_mode:
        grads = torch._foreach_add(grads, work, alpha=weight_decay)
    if weight_decay != 0 and adam_w_mode:
        torch._foreach_mul_(work, 1.0 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    step_size, bias_correction2_sqrt = _bias_corrections(step, lr, beta1, beta2, bias_correction)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(work, exp_avgs, denom, value=-step_size)
    if upcast:
        torch._foreach_copy_(params, work)


def adam(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float = 0.0,
    adam_w_mode: bool = True,
    bias_correction: bool = True,
    backend: Backend | None = None,
) -> None:
    """One Adam (or AdamW) step over lists of tensors, updating params and moments in place.

    Computes, per element and in fp32 for fp16/bf16 params,
    ``m = b1*m + (1-b1)*g``, ``v = b2*v + (1-b2)*g*g`` and
    ``p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)`` with ``bc_i = 1 - b_i**step`` (1 without
    bias correction). Weight decay is decoupled (``p *= 1 - lr*wd`` first, AdamW) when
    ``adam_w_mode``, else L2 (``g += wd*p``), as ``torch.optim.AdamW``/``Adam`` do.

    The Triton kernel (one launch for all tensors) runs on contiguous float32/float16/bfloat16
    CUDA tensors outside autograd when Triton imported; everything else runs
    :func:`adam_reference`.

    Args:
        params: Parameters, all on one device with one dtype (group them first).
        grads: Their gradients, same shapes and dtype.
        exp_avgs: First moments, same shapes; float32 for fp16/bf16 params, else the params'
            dtype.
        exp_avg_sqs: Second moments, like ``exp_avgs``.
        step: The step number being taken, counting from 1 (for bias correction).
        lr: Learning rate.
        beta1: First-moment decay.
        beta2: Second-moment decay.
        eps: Added to the bias-corrected ``sqrt(v)``.
        weight_decay: Weight decay factor.
        adam_w_mode: Decoupled weight decay (AdamW) when True, L2 regularisation when False.
        bias_correction: Divide the moments by ``1 - beta**step``.
        backend: ``"triton"`` or ``"torch"`` to force an implementation (``"triton"`` raises
            when the kernel cannot run); None to choose automatically.

    Raises:
        ValueError: The lists differ in length, shape, device or dtype, or ``step < 1``, or
            ``backend="triton"`` cannot take the tensors.
        RuntimeError: ``backend="triton"`` without Triton.

    Example:
        >>> p, g = torch.ones(4), torch.full((4,), 0.5)
        >>> m, v = torch.zeros(4), torch.zeros(4)
        >>> ds_kernels.adam([p], [g], [m], [v], step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8)
        >>> p
        tensor([0.9000, 0.9000, 0.9000, 0.9000])
    """
    _check_args(params, grads, exp_avgs, exp_avg_sqs, step)
    if not params:
        return
    tensors = [*params, *grads, *exp_avgs, *exp_avg_sqs]
    if choose_backend("adam", _adam_kernel, tensors, _TRITON_DTYPES, backend) == "torch":
        adam_reference(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            step=step,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            adam_w_mode=adam_w_mode,
            bias_correction=bias_correction,
        )
        return
    step_size, bias_correction2_sqrt = _bias_corrections(step, lr, beta1, beta2, bias_correction)
    decay_mode, decay = _NO_DECAY, 0.0
    if weight_decay != 0:
        decay_mode = _DECOUPLED_DECAY if adam_w_mode else _L2_DECAY
        decay = 1.0 - lr * weight_decay if adam_w_mode else weight_decay
    scalars = (1.0 - beta1, beta2, 1.0 - beta2, eps, decay, step_size, bias_correction2_sqrt)
    _launch(tensors, len(params), tuple(float(x) for x in scalars), decay_mode)


def _bias_corrections(
    step: int, lr: float, beta1: float, beta2: float, bias_correction: bool
) -> tuple[float, float]:
    """``(lr / bc1, sqrt(bc2))``, computed in double precision as torch does."""
    if not bias_correction:
        return lr, 1.0
    return lr / (1.0 - beta1**step), math.sqrt(1.0 - beta2**step)


@functools.lru_cache(maxsize=32)
def _chunk_tables(
    device: torch.device, numels: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(numels, owner, first_chunk, num_chunks)`` on ``device`` for [Note: Multi-tensor launch]."""
    sizes = torch.tensor(numels, dtype=torch.int64)
    counts = (sizes + _BLOCK_SIZE - 1) // _BLOCK_SIZE
    owner = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), counts)
    first_chunk = (torch.cumsum(counts, 0) - counts).to(torch.int32)
    num_chunks = int(counts.sum())
    return sizes.to(device), owner.to(device), first_chunk.to(device), num_chunks


def _launch(
    tensors: list[torch.Tensor], num_tensors: int, scalars: tuple[float, ...], decay_mode: int
) -> None:
    params = tensors[:num_tensors]
    device = params[0].device
    numels, owner, first_chunk, num_chunks = _chunk_tables(device, tuple(p.numel() for p in params))
    if num_chunks == 0:
        return
    pointers = [t.data_ptr() for t in tensors]
    addresses = torch.tensor(pointers, dtype=torch.int64).to(device)
    # Triton launches on the current CUDA device, which need not be the tensors' device.
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_device:
        _adam_kernel[(num_chunks,)](
            addresses,
            numels,
            owner,
            first_chunk,
            num_tensors,
            params[0],
            *scalars,
            DECAY_MODE=decay_mode,
            ALIGNED=all(ptr % 16 == 0 for ptr in pointers),
            BLOCK_SIZE=_BLOCK_SIZE,
        )


def _check_args(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    step: int,
) -> None:
    lengths = {len(params), len(grads), len(exp_avgs), len(exp_avg_sqs)}
    if len(lengths) != 1:
        raise ValueError(
            f"adam: params, grads, exp_avgs and exp_avg_sqs must have the same length, got "
            f"{len(params)}, {len(grads)}, {len(exp_avgs)} and {len(exp_avg_sqs)}"
        )
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"adam: step must be an int >= 1 (the step being taken), got {step!r}")
    if not params:
        return
    device, dtype = params[0].device, params[0].dtype
    if not dtype.is_floating_point:
        raise ValueError(f"adam: params must be floating point, got {dtype}")
    state_dtype = torch.float32 if dtype in _LOW_PRECISION else dtype
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        if p.device != device or p.dtype != dtype:
            raise ValueError(
                f"adam: all params must share one device and dtype (group them first), got "
                f"params[0] on {device} as {dtype} and params[{i}] on {p.device} as {p.dtype}"
            )
        for name, t, want in (
            ("grads", g, dtype),
            ("exp_avgs", m, state_dtype),
            ("exp_avg_sqs", v, state_dtype),
        ):
            _check_like(name, i, t, p, want)


def _check_like(
    name: str, i: int, t: torch.Tensor, param: torch.Tensor, dtype: torch.dtype
) -> None:
    if t.shape != param.shape or t.device != param.device or t.dtype != dtype:
        raise ValueError(
            f"adam: {name}[{i}] must have shape {tuple(param.shape)}, device {param.device} and "
            f"dtype {dtype} (float32 moments for fp16/bf16 params), got {tuple(t.shape)}, "
            f"{t.device} and {t.dtype}"
        )
