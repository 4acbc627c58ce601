"""moe_combine and moe_combine_weight_grad: scatter expert outputs back to tokens, weighted.

See [Note: MoE routing as index maps] in ``_moe_dispatch.py``. Both kernels run one program per
token and read that token's ``k`` slots, so they need no atomics and are deterministic.
"""

from __future__ import annotations

import torch

from ds_kernels._dispatch import choose_backend
from ds_kernels._moe_dispatch import (
    check_index,
    check_rows,
    check_weight,
    on_device,
    row_block,
)
from ds_kernels._triton import jit, tl, triton
from ds_kernels.api import Backend

_TRITON_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


@jit
def _moe_combine_kernel(
    expert_ptr,
    token_slot_ptr,
    weight_ptr,
    out_ptr,
    hidden,
    K: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):  # pyright: ignore  (Triton's compile-time range)
        slot = tl.load(token_slot_ptr + token * K + j).to(tl.int64)
        # A dropped choice (-1) reads row 0 with every column masked off: it loads nothing.
        readable = cols < tl.where(slot >= 0, hidden, 0)
        row = tl.load(expert_ptr + tl.maximum(slot, 0) * hidden + cols, mask=readable, other=0.0)
        row = row.to(tl.float32)
        if HAS_WEIGHT:
            row = row * tl.load(weight_ptr + token * K + j).to(tl.float32)
        acc += row
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=in_row)


@jit
def _moe_combine_weight_grad_kernel(
    grad_ptr, expert_ptr, token_slot_ptr, out_ptr, hidden, K: tl.constexpr, BLOCK: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    for j in tl.static_range(K):  # pyright: ignore  (Triton's compile-time range)
        slot = tl.load(token_slot_ptr + token * K + j).to(tl.int64)
        limit = tl.where(slot >= 0, hidden, 0)  # a dropped choice reads nothing
        source = tl.maximum(slot, 0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, hidden, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            g = tl.load(grad_ptr + token * hidden + cols, mask=cols < hidden, other=0.0)
            e = tl.load(expert_ptr + source * hidden + cols, mask=cols < limit, other=0.0)
            acc += g.to(tl.float32) * e.to(tl.float32)
        tl.store(out_ptr + token * K + j, tl.sum(acc, axis=0))


def _gather_choices(expert_out: torch.Tensor, token_slot: torch.Tensor) -> torch.Tensor:
    """``[tokens, k, hidden]`` float32 rows of each choice's slot (row 0 for dropped choices)."""
    tokens, k = token_slot.shape
    flat = token_slot.reshape(-1).clamp(min=0).to(torch.int64)
    return expert_out.index_select(0, flat).view(tokens, k, -1).to(torch.float32)


def moe_combine_reference(
    expert_out: torch.Tensor, token_slot: torch.Tensor, token_weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch reference for :func:`moe_combine` (vectorised: one gather and one batched matmul)."""
    rows = _gather_choices(expert_out, token_slot)
    if token_weight is None:
        weight = torch.ones(token_slot.shape, dtype=torch.float32, device=rows.device)
    else:
        weight = token_weight.to(torch.float32)
    weight = weight.masked_fill(token_slot < 0, 0.0)
    return torch.bmm(weight.unsqueeze(1), rows).squeeze(1).to(expert_out.dtype)


def moe_combine(
    expert_out: torch.Tensor,
    token_slot: torch.Tensor,
    token_weight: torch.Tensor | None = None,
    *,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Sums each token's expert outputs: ``out[s] = sum_j w[s, j] * expert_out[token_slot[s, j]]``.

    Choices whose ``token_slot`` is ``-1`` (dropped) contribute nothing; ``token_weight=None``
    weighs every choice 1 (dispatch's backward). Computed in float32 and rounded once. The Triton
    kernel runs on contiguous float32/float16/bfloat16 CUDA tensors outside autograd when Triton
    imported; everything else runs :func:`moe_combine_reference`.

    Args:
        expert_out: ``[slots, hidden]`` expert outputs.
        token_slot: ``[tokens, k]`` int32/int64 slot of each choice, or ``-1``; values must lie in
            ``[-1, slots)`` (not checked: that would synchronise the GPU).
        token_weight: Optional ``[tokens, k]`` float weight of each choice.
        backend: ``"triton"`` or ``"torch"`` to force an implementation; None to choose.

    Returns:
        A new ``[tokens, hidden]`` tensor with the dtype and device of ``expert_out``.

    Raises:
        ValueError: Bad shapes or devices, or ``backend="triton"`` cannot take the tensors.
        TypeError: ``token_slot`` is not an integer tensor or a weight not a float one.
        RuntimeError: ``backend="triton"`` without Triton.

    Example:
        >>> out = torch.tensor([[1.0, 2.0], [10.0, 20.0]])
        >>> ds_kernels.moe_combine(out, torch.tensor([[1, 0], [-1, 0]]), torch.full((2, 2), 0.5))
        tensor([[ 5.5000, 11.0000],
                [ 0.5000,  1.0000]])
    """
    check_index("moe_combine", "token_slot", token_slot, 2, expert_out.device)
    check_rows("moe_combine", "expert_out", expert_out)
    if token_weight is not None:
        check_weight(
            "moe_combine", "token_weight", token_weight, token_slot.shape, expert_out.device
        )
    floats = [expert_out] if token_weight is None else [expert_out, token_weight]
    kernel = _moe_combine_kernel
    if choose_backend("moe_combine", kernel, floats, _TRITON_DTYPES, backend) == "torch":
        return moe_combine_reference(expert_out, token_slot, token_weight)
    tokens, k = token_slot.shape
    hidden = expert_out.size(1)
    out = expert_out.new_empty((tokens, hidden))
    if out.numel() == 0:
        return out
    block = row_block(hidden)
    slots = token_slot.contiguous()
    weight = slots if token_weight is None else token_weight  # never read without a weight
    with on_device(expert_out):
        _moe_combine_kernel[(tokens, triton.cdiv(hidden, block))](
            expert_out,
            slots,
            weight,
            out,
            hidden,
            K=k,
            HAS_WEIGHT=token_weight is not None,
            BLOCK=block,
        )
    return out


def moe_combine_weight_grad_reference(
    grad_out: torch.Tensor, expert_out: torch.Tensor, token_slot: torch.Tensor
) -> torch.Tensor:
    """Torch reference for :func:`moe_combine_weight_grad`."""
    rows = _gather_choices(expert_out, token_slot)
    grad = torch.bmm(rows, grad_out.to(torch.float32).unsqueeze(2)).squeeze(2)
    return grad.masked_fill_(token_slot < 0, 0.0)


def moe_combine_weight_grad(
    grad_out: torch.Tensor,
    expert_out: torch.Tensor,
    token_slot: torch.Tensor,
    *,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Gradient of :func:`moe_combine` with respect to its weights.

    ``grad[s, j] = dot(grad_out[s], expert_out[token_slot[s, j]])``, zero for dropped choices,
    accumulated in float32. Dispatched like :func:`moe_combine`.

    Args:
        grad_out: ``[tokens, hidden]`` gradient of the combined output.
        expert_out: ``[slots, hidden]`` expert outputs, same dtype as ``grad_out``.
        token_slot: ``[tokens, k]`` int32/int64 slot of each choice, or ``-1``.
        backend: ``"triton"`` or ``"torch"`` to force an implementation; None to choose.

    Returns:
        A new float32 ``[tokens, k]`` tensor on the device of ``grad_out``.

    Raises:
        ValueError: Bad shapes or devices, or ``backend="triton"`` cannot take the tensors.
        TypeError: Integer rows, differing dtypes, or a non-integer ``token_slot``.
        RuntimeError: ``backend="triton"`` without Triton.
    """
    op = "moe_combine_weight_grad"
    check_index(op, "token_slot", token_slot, 2, expert_out.device)
    check_rows(op, "expert_out", expert_out)
    check_rows(op, "grad_out", grad_out)
    if grad_out.shape != (token_slot.size(0), expert_out.size(1)):
        raise ValueError(
            f"{op}: grad_out must have shape {(token_slot.size(0), expert_out.size(1))} "
            f"([tokens, hidden]), got {tuple(grad_out.shape)}"
        )
    if grad_out.dtype != expert_out.dtype or grad_out.device != expert_out.device:
        raise TypeError(
            f"{op}: grad_out ({grad_out.dtype} on {grad_out.device}) and expert_out "
            f"({expert_out.dtype} on {expert_out.device}) must match in dtype and device"
        )
    kernel = _moe_combine_weight_grad_kernel
    tensors = (grad_out, expert_out)
    if choose_backend(op, kernel, tensors, _TRITON_DTYPES, backend) == "torch":
        return moe_combine_weight_grad_reference(grad_out, expert_out, token_slot)
    tokens, k = token_slot.shape
    out = torch.empty((tokens, k), dtype=torch.float32, device=grad_out.device)
    if tokens == 0 or k == 0:
        return out
    with on_device(grad_out):
        _moe_combine_weight_grad_kernel[(tokens,)](
            grad_out,
            expert_out,
            token_slot.contiguous(),
            out,
            expert_out.size(1),
            K=k,
            BLOCK=row_block(expert_out.size(1)),
        )
    return out
