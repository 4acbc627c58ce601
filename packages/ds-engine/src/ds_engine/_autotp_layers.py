"""Tensor-parallel linear layers: the column- and row-parallel halves of a Megatron-style split.

A column-parallel linear holds a slice of the output features; a row-parallel one a slice of the
input features and all-reduces its partial output over the tensor-parallel group. A column layer
followed (through elementwise work or per-head attention) by a row layer computes the full
layer's output on every rank with one all-reduce forward and one backward.
"""

from __future__ import annotations

from typing import Any, TypeGuard

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


def _mark(param: nn.Parameter, dim: int, sections: tuple[int, ...] | None = None) -> None:
    # DeepSpeed's / Megatron's marks: the engine's norm rule counts marked parameters per shard.
    param.tensor_model_parallel = True  # type: ignore[attr-defined]
    param.partition_dim = dim  # type: ignore[attr-defined]
    param.partition_stride = 1 if sections is None else len(sections)  # type: ignore[attr-defined]
    param.fused_sections = sections  # type: ignore[attr-defined]


def shard_tensor(
    full: torch.Tensor, dim: int, tp_rank: int, tp_size: int, sections: tuple[int, ...] | None
) -> torch.Tensor:
    """This rank's shard of ``full`` along ``dim``: a contiguous chunk, or with ``sections``
    (a fused projection's parts, e.g. q, k, v) the rank's chunk of every part, concatenated."""
    if sections is None:
        return full.chunk(tp_size, dim=dim)[tp_rank].clone()
    parts = full.split(list(sections), dim=dim)
    return torch.cat([p.chunk(tp_size, dim=dim)[tp_rank] for p in parts], dim=dim)


def merge_shards(
    shards: list[torch.Tensor], dim: int, sections: tuple[int, ...] | None
) -> torch.Tensor:
    """The inverse of :func:`shard_tensor` over every rank's shard (in tp-rank order)."""
    if sections is None:
        return torch.cat(shards, dim=dim)
    local = [size // len(shards) for size in sections]
    pieces = [shard.split(local, dim=dim) for shard in shards]
    return torch.cat([torch.cat([p[i] for p in pieces], dim=dim) for i in range(len(local))], dim)


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2): a linear storing its weight as ``[in, out]``."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def is_tensor_parallel_layer(module: nn.Module) -> TypeGuard[_TensorParallelLinear]:
    """Whether ``module`` is a column- or row-parallel layer of ``tp_model_init``."""
    return isinstance(module, _TensorParallelLinear)


class _TensorParallelLinear(nn.Module):
    """Shared state of both layers: the shard, the group and the full shape it came from.

    ``linear`` is an ``nn.Linear`` or a transformers ``Conv1D`` (``transposed``: the weight is
    stored ``[in, out]`` and stays so, so the state dict keeps the original layout).
    """

    split_out: bool  # column: the output features are split; row: the input features

    def __init__(
        self,
        linear: nn.Module,
        group: Any,
        tp_rank: int,
        tp_size: int,
        sections: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        self.group, self.tp_rank, self.tp_size = group, tp_rank, tp_size
        self.transposed = is_conv1d(linear)
        if self.transposed:
            self.in_features = int(getattr(linear, "nx"))  # noqa: B009 (Module.__getattr__)
            self.out_features = int(getattr(linear, "nf"))  # noqa: B009
        else:
            self.in_features, self.out_features = linear.in_features, linear.out_features
        self.sections = tuple(sections) if sections is not None else None
        out_dim = 1 if self.transposed else 0
        self.partition_dim = out_dim if self.split_out else 1 - out_dim
        source = linear.weight
        assert isinstance(source, torch.Tensor)
        weight = shard_tensor(source.detach(), self.partition_dim, tp_rank, tp_size, self.sections)
        self.weight = nn.Parameter(weight, requires_grad=source.requires_grad)
        _mark(self.weight, self.partition_dim, self.sections)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = self.weight.t() if self.transposed else self.weight
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        fused = f", sections={self.sections}" if self.sections else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, tp_rank={self.tp_rank}, tp_size={self.tp_size}"
            f"{', conv1d' if self.transposed else ''}{fused}"
        )


class ColumnParallelLinear(_TensorParallelLinear):
    """``nn.Linear`` with its output features split over the group; its output is the local slice.

    With ``sections`` (a fused projection: GPT-2's ``c_attn`` q|k|v, a ``gate_up_proj``), each
    part is split by itself, so the local output is this rank's slice of q, then of k, then of v.
    Forward: the local matmul. Backward: the input gradient is all-reduced over the group.
    """

    split_out = True

    def __init__(
        self,
        linear: nn.Module,
        group: Any,
        tp_rank: int,
        tp_size: int,
        sections: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__(linear, group, tp_rank, tp_size, sections)
        self.bias: nn.Parameter | None = None
        source = linear.bias
        if isinstance(source, torch.Tensor):
            bias = shard_tensor(source.detach(), 0, tp_rank, tp_size, self.sections)
            self.bias = nn.Parameter(bias, requires_grad=source.requires_grad)
            _mark(self.bias, 0, self.sections)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTensorParallel.apply(x, self.group)
        return self._matmul(x, self.bias)


class RowParallelLinear(_TensorParallelLinear):
    """``nn.Linear`` with its input features split; it takes the input's local slice.

    Forward: the local matmul, an all-reduce of the partial output over the group, then the
    (replicated, unmarked) bias once.
    """

    split_out = False

    def __init__(
        self,
        linear: nn.Module,
        group: Any,
        tp_rank: int,
        tp_size: int,
        sections: tuple[int, ...] | None = None,
    ) -> None:
        if sections is not None:
            raise ValueError("RowParallelLinear: fused sections split output features only")
        super().__init__(linear, group, tp_rank, tp_size)
        self.bias = None
        source = linear.bias
        if isinstance(source, torch.Tensor):
            self.bias = nn.Parameter(source.detach().clone(), requires_grad=source.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _ReduceFromTensorParallel.apply(self._matmul(x, None), self.group)
        return out if self.bias is None else out + self.bias
