"""Tensor-parallel linear layers: the column- and row-parallel halves of a Megatron-style split.

A column-parallel linear holds a slice of the output features; a row-parallel one a slice of the
input features and all-reduces its partial output over the tensor-parallel group. A column layer
followed (through elementwise work or per-head attention) by a row layer computes the full
layer's output on every rank with one all-reduce forward and one backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ds_comm


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient backward (each rank saw a slice)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grads[0].contiguous().clone()
        ds_comm.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """All-reduce of the partial outputs forward; identity backward (the sum's gradient)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        out = tensor.contiguous().clone()
        ds_comm.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grads[0], None


def _mark(param: nn.Parameter, dim: int) -> None:
    # DeepSpeed's / Megatron's marks: the engine's norm rule counts marked parameters per shard.
    param.tensor_model_parallel = True  # type: ignore[attr-defined]
    param.partition_dim = dim  # type: ignore[attr-defined]
    param.partition_stride = 1  # type: ignore[attr-defined]


class _TensorParallelLinear(nn.Module):
    """Shared state of both layers: the shard, the group and the full shape it came from."""

    partition_dim: int

    def __init__(self, linear: nn.Linear, group: Any, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.group, self.tp_rank, self.tp_size = group, tp_rank, tp_size
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().chunk(tp_size, dim=self.partition_dim)[tp_rank]
        self.weight = nn.Parameter(weight.clone(), requires_grad=linear.weight.requires_grad)
        _mark(self.weight, self.partition_dim)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, tp_rank={self.tp_rank}, tp_size={self.tp_size}"
        )


class ColumnParallelLinear(_TensorParallelLinear):
    """``nn.Linear`` with its output features split over the group; its output is the local slice.

    Forward: the local matmul. Backward: the input gradient is all-reduced over the group.
    """

    partition_dim = 0

    def __init__(self, linear: nn.Linear, group: Any, tp_rank: int, tp_size: int) -> None:
        super().__init__(linear, group, tp_rank, tp_size)
        self.bias: nn.Parameter | None = None
        if linear.bias is not None:
            bias = linear.bias.detach().chunk(tp_size)[tp_rank].clone()
            self.bias = nn.Parameter(bias, requires_grad=linear.bias.requires_grad)
            _mark(self.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTensorParallel.apply(x, self.group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(_TensorParallelLinear):
    """``nn.Linear`` with its input features split; it takes the input's local slice.

    Forward: the local matmul, an all-reduce of the partial output over the group, then the
    (replicated, unmarked) bias once.
    """

    partition_dim = 1

    def __init__(self, linear: nn.Linear, group: Any, tp_rank: int, tp_size: int) -> None:
        super().__init__(linear, group, tp_rank, tp_size)
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(
                linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _ReduceFromTensorParallel.apply(F.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias
