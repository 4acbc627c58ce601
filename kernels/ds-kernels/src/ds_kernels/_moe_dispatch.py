"""moe_dispatch: gather the tokens routed to each expert slot into the experts' input buffer.

[Note: MoE routing as index maps]
A mixture-of-experts layer with ``E`` experts of capacity ``C`` sends each token to up to ``k``
slots of a ``[E * C, hidden]`` buffer. GShard (and DeepSpeed) express this with a dense one-hot
``[tokens, E, C]`` tensor and two einsums, which cost ``tokens * E * C * hidden`` multiply-adds
for what is a copy. Here routing is two index maps instead:

* ``slot_token[E * C]``: the token each slot holds, ``-1`` for an empty slot;
* ``token_slot[tokens, k]``: the slot each of a token's ``k`` choices landed in, ``-1`` when the
  choice was dropped (over capacity) or masked.

Dispatch is then a row gather (``out[i] = tokens[slot_token[i]]``, zeros for empty slots) and
combine (``_moe_combine.py``) a weighted gather-sum from the token side
(``out[s] = sum_j w[s, j] * expert_out[token_slot[s, j]]``). Both run one program per output row,
read each input row once, write each output row once, and need no atomics; each is the other's
backward (dispatch's backward is an unweighted combine; combine's backward is a dispatch scaled by
the slot's weight, plus ``moe_combine_weight_grad`` for the weights), so training is
deterministic. Work is ``O((tokens * k + E * C) * hidden)`` whatever ``E`` is.
"""

from __future__ import annotations

import contextlib

import torch

from ds_kernels._dispatch import choose_backend
from ds_kernels._triton import jit, tl, triton
from ds_kernels.api import Backend

_MAX_BLOCK = 2048
_TRITON_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
_INDEX_DTYPES = (torch.int32, torch.int64)


@jit
def _moe_dispatch_kernel(
    tokens_ptr,
    slot_token_ptr,
    slot_weight_ptr,
    out_ptr,
    hidden,
    HAS_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    slot = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < hidden
    token = tl.load(slot_token_ptr + slot).to(tl.int64)
    # An empty slot (-1) reads row 0 with every column masked off: it loads nothing.
    source = tl.maximum(token, 0)
    readable = cols < tl.where(token >= 0, hidden, 0)
    row = tl.load(tokens_ptr + source * hidden + cols, mask=readable, other=0.0)
    row = row.to(tl.float32)
    if HAS_WEIGHT:
        row = row * tl.load(slot_weight_ptr + slot).to(tl.float32)
    tl.store(out_ptr + slot * hidden + cols, row.to(out_ptr.dtype.element_ty), mask=in_row)


def moe_dispatch_reference(
    tokens: torch.Tensor, slot_token: torch.Tensor, slot_weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Torch reference for :func:`moe_dispatch` (vectorised: one gather, no Python loop)."""
    empty = slot_token < 0
    out = tokens.index_select(0, slot_token.clamp(min=0).to(torch.int64))
    if slot_weight is not None:
        out = (out.to(torch.float32) * slot_weight.to(torch.float32).unsqueeze(1)).to(tokens.dtype)
    # ``out`` is a fresh tensor, so filling it in place is safe (also under autograd).
    return out.masked_fill_(empty.unsqueeze(1), 0)


def moe_dispatch(
    tokens: torch.Tensor,
    slot_token: torch.Tensor,
    slot_weight: torch.Tensor | None = None,
    *,
    backend: Backend | None = None,
) -> torch.Tensor:
    """Gathers token rows into expert slots: ``out[i] = slot_weight[i] * tokens[slot_token[i]]``.

    Slots whose ``slot_token`` is ``-1`` are zero. See [Note: MoE routing as index maps]. The
    Triton kernel computes in float32 and rounds once; it runs on contiguous float32, float16 or
    bfloat16 CUDA tensors outside autograd when Triton imported; everything else runs
    :func:`moe_dispatch_reference`.

    Args:
        tokens: ``[tokens, hidden]`` rows to gather.
        slot_token: ``[slots]`` int32/int64 row of ``tokens`` for each slot, or ``-1`` (empty);
            values must lie in ``[-1, tokens)`` (not checked: that would synchronise the GPU).
        slot_weight: Optional ``[slots]`` float scale per slot (combine's backward uses it).
        backend: ``"triton"`` or ``"torch"`` to force an implementation; None to choose.

    Returns:
        A new ``[slots, hidden]`` tensor with the dtype and device of ``tokens``.

    Raises:
        ValueError: Bad shapes or devices, or ``backend="triton"`` cannot take the tensors.
        TypeError: ``slot_token`` is not an integer tensor or ``slot_weight`` not a float one.
        RuntimeError: ``backend="triton"`` without Triton.

    Example:
        >>> ds_kernels.moe_dispatch(torch.arange(6.0).view(3, 2), torch.tensor([2, -1, 0]))
        tensor([[4., 5.],
                [0., 0.],
                [0., 1.]])
    """
    check_index("moe_dispatch", "slot_token", slot_token, 1, tokens.device)
    check_rows("moe_dispatch", "tokens", tokens)
    if slot_weight is not None:
        check_weight("moe_dispatch", "slot_weight", slot_weight, slot_token.shape, tokens.device)
    floats = [tokens] if slot_weight is None else [tokens, slot_weight]
    kernel = _moe_dispatch_kernel
    if choose_backend("moe_dispatch", kernel, floats, _TRITON_DTYPES, backend) == "torch":
        return moe_dispatch_reference(tokens, slot_token, slot_weight)
    return _launch(tokens, slot_token.contiguous(), slot_weight)


def _launch(
    tokens: torch.Tensor, slot_token: torch.Tensor, slot_weight: torch.Tensor | None
) -> torch.Tensor:
    slots, hidden = slot_token.numel(), tokens.size(1)
    out = tokens.new_empty((slots, hidden))
    if out.numel() == 0:
        return out
    block = row_block(hidden)
    grid = (slots, triton.cdiv(hidden, block))
    weight = slot_token if slot_weight is None else slot_weight  # never read without a weight
    with on_device(tokens):
        _moe_dispatch_kernel[grid](
            tokens, slot_token, weight, out, hidden, HAS_WEIGHT=slot_weight is not None, BLOCK=block
        )
    return out


def row_block(hidden: int) -> int:
    """Columns one program handles: the whole row up to ``_MAX_BLOCK``, a power of two."""
    return min(triton.next_power_of_2(hidden), _MAX_BLOCK)


def on_device(t: torch.Tensor) -> contextlib.AbstractContextManager[object]:
    """Triton launches on the current CUDA device, which need not be the tensors' device."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def check_rows(op: str, name: str, t: torch.Tensor) -> None:
    """``t`` must be a 2-D floating tensor of rows."""
    if t.dim() != 2:
        raise ValueError(f"{op}: {name} must be 2-D [rows, hidden], got shape {tuple(t.shape)}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{op}: {name} must be a floating tensor, got {t.dtype}")


def check_index(op: str, name: str, index: torch.Tensor, dim: int, device: torch.device) -> None:
    """``index`` must be a ``dim``-D int32/int64 tensor on ``device``."""
    if index.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{op}: {name} must be an int32 or int64 tensor, got {index.dtype}")
    if index.dim() != dim:
        raise ValueError(f"{op}: {name} must be {dim}-D, got shape {tuple(index.shape)}")
    if index.device != device:
        raise ValueError(f"{op}: {name} is on {index.device} but the rows are on {device}")


def check_weight(
    op: str, name: str, weight: torch.Tensor, shape: torch.Size, device: torch.device
) -> None:
    """``weight`` must be a floating tensor of ``shape`` on ``device``."""
    if not weight.dtype.is_floating_point:
        raise TypeError(f"{op}: {name} must be a floating tensor, got {weight.dtype}")
    if weight.shape != shape:
        raise ValueError(
            f"{op}: {name} must have shape {tuple(shape)} (one per index), "
            f"got {tuple(weight.shape)}"
        )
    if weight.device != device:
        raise ValueError(f"{op}: {name} is on {weight.device} but the rows are on {device}")
