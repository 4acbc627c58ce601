"""Ulysses sequence parallelism: DeepSpeed's ``deepspeed.sequence.layer.DistributedAttention``.

Each rank of the sequence-parallel group holds a slice of the sequence with every head. One
all-to-all per tensor turns q, k and v into the full sequence with ``heads / P`` heads, the local
attention runs on that (attention is independent per head), and a second all-to-all turns the
output back into the rank's sequence slice with every head. The all-to-alls are differentiable:
each one's backward is the inverse all-to-all of the gradient.

Layouts (``batch_dim_idx`` as DeepSpeed passes it to ``forward``): ``1`` is ``[s, b, h, d]``
(sequence first, Megatron's), ``0`` is ``[b, s, h, d]``. Heads are always dim 2.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import ds_comm

__all__ = ["DistributedAttention"]

_HEAD_DIM = 2


def _exchange(x: Tensor, group: Any) -> Tensor:
    """All-to-all over dim 0 of ``x`` (dim 0 has one block per rank)."""
    out = torch.empty_like(x)
    ds_comm.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: Tensor, seq_dim: int, group: Any, size: int) -> Tensor:
    """``[.., s/P, .., h, d]`` -> ``[.., s, .., h/P, d]`` (the rank's heads, every rank's rows)."""
    heads = x.shape[_HEAD_DIM]
    if heads % size != 0:
        raise ValueError(
            f"DistributedAttention: the number of heads ({heads}) must be divisible by the "
            f"sequence parallel size ({size}); use a head count that is a multiple of {size} or "
            f"a smaller sequence_process_group"
        )
    blocks = x.unflatten(_HEAD_DIM, (size, heads // size)).movedim(_HEAD_DIM, 0).contiguous()
    out = _exchange(blocks, group)  # out[j]: rank j's sequence slice of this rank's heads
    return out.movedim(0, seq_dim).flatten(seq_dim, seq_dim + 1)


def _heads_to_seq(x: Tensor, seq_dim: int, group: Any, size: int) -> Tensor:
    """``[.., s, .., h/P, d]`` -> ``[.., s/P, .., h, d]`` (inverse of :func:`_seq_to_heads`)."""
    rows = x.shape[seq_dim]
    blocks = x.unflatten(seq_dim, (size, rows // size)).movedim(seq_dim, 0).contiguous()
    out = _exchange(blocks, group)  # out[j]: this rank's sequence slice of rank j's heads
    return out.movedim(0, _HEAD_DIM).flatten(_HEAD_DIM, _HEAD_DIM + 1)


class _SeqAllToAll(torch.autograd.Function):
    """The differentiable all-to-all: the backward is the opposite exchange of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, size: int, seq_dim: int, to_heads: bool) -> Tensor:
        ctx.group, ctx.size, ctx.seq_dim, ctx.to_heads = group, size, seq_dim, to_heads
        if to_heads:
            return _seq_to_heads(x, seq_dim, group, size)
        return _heads_to_seq(x, seq_dim, group, size)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None, None]:
        if ctx.to_heads:
            return _heads_to_seq(grad, ctx.seq_dim, ctx.group, ctx.size), None, None, None, None
        return _seq_to_heads(grad, ctx.seq_dim, ctx.group, ctx.size), None, None, None, None


def _check_tensor(name: str, x: Tensor) -> None:
    if x.dim() != 4:
        raise ValueError(
            f"DistributedAttention: {name} has shape {tuple(x.shape)}; it takes 4-D tensors "
            f"laid out [s, b, h, d] (batch_dim_idx=1) or [b, s, h, d] (batch_dim_idx=0)"
        )


class DistributedAttention(torch.nn.Module):
    """Ulysses attention over a sequence-parallel group (DeepSpeed's ``DistributedAttention``).

    Args:
        local_attention: attention over full-sequence q, k, v with ``heads / P`` heads, called as
            ``local_attention(q, k, v, *args, **kwargs)`` in the input layout; returns the
            context in that layout.
        sequence_process_group: the sequence-parallel group (``None``: the default group).
        scatter_idx: the heads dim the first all-to-all scatters: 2, as in DeepSpeed.
        gather_idx: the sequence dim it gathers, used when ``forward`` gets no
            ``batch_dim_idx``: 0 for ``[s, b, h, d]``, 1 for ``[b, s, h, d]``.
        sp_stream: DeepSpeed's overlap of the all-to-alls with compute; refused (not
            implemented) unless ``None``.
        num_kv_heads: the key/value head count; only checked (heads must divide evenly by
            the group size: DeepSpeed's uneven head split is not implemented).
    """

    def __init__(
        self,
        local_attention: Any,
        sequence_process_group: Any,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: Any = None,
        num_kv_heads: int | None = None,
    ) -> None:
        super().__init__()
        if scatter_idx != _HEAD_DIM:
            raise ValueError(
                f"DistributedAttention: scatter_idx={scatter_idx} is not supported; the heads "
                f"dim of [s, b, h, d] and [b, s, h, d] is 2 (scatter_idx=2)"
            )
        if gather_idx not in (0, 1):
            raise ValueError(
                f"DistributedAttention: gather_idx={gather_idx} is not a sequence dim; use 0 for "
                f"[s, b, h, d] or 1 for [b, s, h, d]"
            )
        if sp_stream is not None:
            raise NotImplementedError(
                "DistributedAttention: sp_stream (overlapping the all-to-alls with compute) is "
                "not implemented in ds; pass sp_stream=None"
            )
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.sp_stream = None
        self.num_kv_heads = num_kv_heads

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        batch_dim_idx: int | None = None,
        rotary_pos_emb: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> Tensor:
        """Attention of this rank's sequence slice against the whole sequence.

        Args:
            query, key, value: this rank's sequence slice, every head.
            batch_dim_idx: 1 for ``[s, b, h, d]``, 0 for ``[b, s, h, d]``; ``None`` takes
                the layout from ``gather_idx``.
            rotary_pos_emb: DeepSpeed's in-layer rotary embedding; refused unless ``None``
                (apply RoPE before calling).
            args, kwargs: passed to ``local_attention``.

        Returns:
            The context for this rank's sequence slice, every head, in the input layout.
        """
        if rotary_pos_emb is not None:
            raise NotImplementedError(
                "DistributedAttention: rotary_pos_emb is not implemented in ds; apply the "
                "rotary embedding to q and k before calling and pass rotary_pos_emb=None"
            )
        if batch_dim_idx is None:
            seq_dim = self.gather_idx
        elif batch_dim_idx in (0, 1):
            seq_dim = 1 - batch_dim_idx
        else:
            raise ValueError(
                f"DistributedAttention: batch_dim_idx={batch_dim_idx}; use 1 for [s, b, h, d] "
                f"or 0 for [b, s, h, d]"
            )
        size = ds_comm.get_world_size(self.spg)
        for name, x in (("query", query), ("key", key), ("value", value)):
            _check_tensor(name, x)
        self._check_heads(key, size)
        q, k, v = (
            _SeqAllToAll.apply(x, self.spg, size, seq_dim, True) for x in (query, key, value)
        )
        context = self.local_attn(q, k, v, *args, **kwargs)
        return _SeqAllToAll.apply(context, self.spg, size, seq_dim, False)

    def _check_heads(self, key: Tensor, size: int) -> None:
        heads = self.num_kv_heads if self.num_kv_heads is not None else key.shape[_HEAD_DIM]
        if heads % size != 0:
            raise ValueError(
                f"DistributedAttention: the number of key/value heads ({heads}) must be "
                f"divisible by the sequence parallel size ({size}); DeepSpeed's uneven head "
                f"split is not implemented in ds"
            )
