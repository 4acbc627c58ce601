"""Differentiable token movement: dispatch to expert slots, all-to-all, combine back to tokens.

Dispatch and combine are ``ds_kernels`` ops (Triton on CUDA, the vectorised torch reference on
CPU) wrapped in autograd functions whose backward passes are the same ops run the other way (see
[Note: MoE routing as index maps] in ``ds_kernels/_moe_dispatch.py``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

import ds_comm
import ds_kernels
from ds_moe.api import Routing

__all__ = ["all_to_all", "combine", "dispatch"]


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, tokens: torch.Tensor, slot_token: torch.Tensor, token_slot: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(token_slot)
        return ds_kernels.moe_dispatch(tokens, slot_token)

    @staticmethod
    @once_differentiable
    def backward(  # pyright: ignore[reportIncompatibleMethodOverride]  (torch: *grad_outputs)
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor, None, None]:
        (token_slot,) = ctx.saved_tensors
        # Each token's gradient is the sum over the slots its choices took.
        return ds_kernels.moe_combine(grad.contiguous(), token_slot), None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx,
        expert_out: torch.Tensor,
        weight: torch.Tensor,
        token_slot: torch.Tensor,
        slot_token: torch.Tensor,
        slot_source: torch.Tensor,
    ) -> torch.Tensor:
        ctx.save_for_backward(expert_out, weight, token_slot, slot_token, slot_source)
        return ds_kernels.moe_combine(expert_out, token_slot, weight)

    @staticmethod
    @once_differentiable
    def backward(  # pyright: ignore[reportIncompatibleMethodOverride]  (torch: *grad_outputs)
        ctx: Any, grad: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        expert_out, weight, token_slot, slot_token, slot_source = ctx.saved_tensors
        grad = grad.contiguous()
        grad_expert = grad_weight = None
        if ctx.needs_input_grad[0]:
            # A slot's gradient is its token's gradient times the weight of the choice it holds.
            source = slot_source.clamp(min=0)
            slot_weight = (
                weight.reshape(-1).index_select(0, source).masked_fill(slot_token < 0, 0.0)
            )
            grad_expert = ds_kernels.moe_dispatch(grad, slot_token, slot_weight)
        if ctx.needs_input_grad[1]:
            grad_weight = ds_kernels.moe_combine_weight_grad(grad, expert_out, token_slot)
            grad_weight = grad_weight.to(weight.dtype)
        return grad_expert, grad_weight, None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, group: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.group = group  # type: ignore[attr-defined]
        x = x.contiguous()
        out = torch.empty_like(x)
        ds_comm.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(  # pyright: ignore[reportIncompatibleMethodOverride]  (torch: *grad_outputs)
        ctx: Any, grad: torch.Tensor
    ) -> tuple[None, torch.Tensor]:
        # Equal blocks: the transpose of an all-to-all is the same all-to-all.
        return None, _AllToAll.apply(ctx.group, grad)


def dispatch(tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``[num_experts * capacity, hidden]`` expert input buffer: each slot's token, or zeros."""
    return _Dispatch.apply(tokens, routing.slot_token, routing.token_slot)


def combine(expert_out: torch.Tensor, routing: Routing) -> torch.Tensor:
    """``[tokens, hidden]``: each token's expert outputs summed with its combine weights."""
    return _Combine.apply(
        expert_out,
        routing.combine_weight,
        routing.token_slot,
        routing.slot_token,
        routing.slot_source,
    )


def all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` of equal blocks along dim 0 over ``group``."""
    return _AllToAll.apply(group, x)
