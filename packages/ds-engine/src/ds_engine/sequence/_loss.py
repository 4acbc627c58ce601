"""The loss of a sequence split over a sequence-parallel group, weighted by tokens.

Each rank of the group holds a slice of the sequence and computes the mean loss of its own
tokens. The sequence's loss is the token-weighted mean of those: a rank whose slice has more
labelled tokens (prompt tokens masked with ``-100`` are not counted) weighs more, so SP=P gives
the loss SP=1 computes on the whole sequence.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import ds_comm

__all__ = ["sequence_parallel_loss"]


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces the gradient (every rank's copy of the
    result depends on every rank's input)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        out = x.detach().clone()
        ds_comm.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        ds_comm.all_reduce(grad, group=ctx.group)
        return grad, None


def sequence_parallel_loss(loss: Tensor, num_tokens: Tensor | int, group: Any) -> Tensor:
    """The token-weighted mean of every sequence rank's loss (the same value on each rank).

    Args:
        loss: this rank's mean loss over its ``num_tokens`` tokens (a scalar; NaN or anything
            when ``num_tokens`` is 0: it is then left out).
        num_tokens: the tokens that mean is over (e.g. ``(shift_labels != -100).sum()``).
        group: the sequence-parallel group (``engine.seq_parallel_group``,
            ``groups._get_sequence_parallel_group()``). ``None`` is every rank, as in
            ``torch.distributed`` (the engine's group is None when sequence parallelism is
            off: pass it only when ``engine.sequence_parallel_size > 1``).

    Returns:
        ``sum(loss_r * tokens_r) / sum(tokens_r)`` over the group (0 when no rank has a token).
        Its backward reaches each rank's own tokens from every rank, as an all-gather of the
        losses does (transformers' recipe); the engine's gradient average over the
        ``sp x dp`` group divides that back out (see docs/sequence_parallel.md).

    Example:
        >>> loss = F.cross_entropy(logits.flatten(0, 1), shift_labels.flatten(), ignore_index=-100)
        >>> tokens = (shift_labels != -100).sum()
        >>> loss = sequence_parallel_loss(loss, tokens, engine.seq_parallel_group)
        >>> engine.backward(loss)
    """
    if not torch.is_tensor(loss) or loss.numel() != 1:
        raise ValueError(
            f"sequence_parallel_loss(loss): expected a scalar loss tensor, got "
            f"{tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__}"
        )
    if not ds_comm.is_initialized():  # one process: its loss is the sequence's loss
        return loss.reshape(())
    count = torch.as_tensor(num_tokens, device=loss.device).reshape(()).to(loss.dtype)
    local = torch.where(count > 0, loss.reshape(()) * count, torch.zeros_like(loss.reshape(())))
    total = _SumOverGroup.apply(local, group)
    tokens = count.detach().clone()
    ds_comm.all_reduce(tokens, group=group)
    return total / tokens.clamp(min=1)
