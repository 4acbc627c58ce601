"""Global gradient norm and clipping, for whole or sharded gradients in fp32, fp16 or bf16.

[Note: which ranks a norm covers]
With ``group=None`` the tensors passed are all there is and nothing is communicated, as in
``torch.nn.utils.clip_grad_norm_`` and DeepSpeed's ``clip_grad_norm_(mpu=None)``. With a group,
each rank holds a disjoint shard of the gradients (ZeRO's partitions, a tensor-parallel slice):
the per-rank sums of ``|g|**p`` are all-reduced with SUM, or the per-rank maxima with MAX for the
inf-norm, so every rank gets the norm of the whole. Gradients that are replicated across the
group (data parallel after its all-reduce) must not be reduced again: pass ``group=None``.

[Note: norm precision and non-finite values]
Each tensor's norm is computed in fp32 (``vector_norm(dtype=float32)``), so fp16 gradients whose
squares overflow fp16 still give a finite norm; the inf-norm is a max and is exact in any dtype.
Per-tensor norms are combined in fp64, where ``norm**p`` cannot overflow before the root is taken.
Any inf in a gradient makes the norm inf, any nan makes it nan (inf and nan together: nan), on
every rank. Gloo's MAX keeps the other operand when one is nan, so the inf-norm's all-reduce
carries a separate nan flag.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

import ds_comm

__all__ = ["clip_grad_norm_", "global_grad_norm", "grads_of"]

TensorsOrParams = torch.Tensor | Iterable[torch.Tensor]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def grads_of(tensors_or_params: TensorsOrParams) -> list[torch.Tensor]:
    """The gradients among ``tensors_or_params``: each parameter's ``.grad`` (none is skipped),
    and any tensor that does not require grad as it is (already a gradient or a shard of one)."""
    items = (
        [tensors_or_params] if isinstance(tensors_or_params, torch.Tensor) else tensors_or_params
    )
    grads = []
    for item in items:
        grad = item.grad if isinstance(item, torch.nn.Parameter) or item.requires_grad else item
        if grad is not None:
            grads.append(grad.detach())
    return grads


def _norm_type(norm_type: float | str) -> float:
    p = float(norm_type)  # "inf" works too, as in torch
    if math.isnan(p) or p <= 0:
        raise ValueError(f"norm_type = {norm_type!r}: expected a positive number or inf")
    return p


def _per_tensor_norms(grads: list[torch.Tensor], p: float) -> list[torch.Tensor]:
    """fp32 norms of each non-empty gradient; see [Note: norm precision and non-finite values]."""
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        if g.numel() > 0:
            buckets[(g.device, g.dtype)].append(g)
    norms: list[torch.Tensor] = []
    for (device, dtype), tensors in buckets.items():
        if device.type == "cpu":
            by_rows = [t.numel() >= _LARGE_CPU_NUMEL and t.is_contiguous() for t in tensors]
            norms.extend(_cpu_norm_by_rows(t, p) for t, rows in zip(tensors, by_rows) if rows)
            tensors = [t for t, rows in zip(tensors, by_rows) if not rows]
            if not tensors:
                continue
        if p == math.inf or dtype not in _LOW_PRECISION:
            norms.extend(n.float() for n in torch._foreach_norm(tensors, p))
        else:
            norms.extend(torch.linalg.vector_norm(t, p, dtype=torch.float32) for t in tensors)
    return norms


# [Note: large CPU norms]
# torch reduces one long CPU vector on one thread: ``vector_norm`` over a 981M-element fp32
# gradient (a ZeRO-Offload partition) took 0.40 s on a 16-core host at 8 threads, about 10 GB/s,
# the same at 1 and 2 threads here. Reducing its rows (dim=1) spreads them over the intra-op
# threads (2 threads: 17 GB/s against 8 here), and the norm of the rows' norms is the norm. Rows
# of 2**14 are summed as precisely as the whole (each row's sum is itself blocked); much longer
# rows lose digits (2**20: a relative 1e-5 on 200M standard normals, against 2e-8 at 2**14).
_NORM_ROW = 1 << 14
_LARGE_CPU_NUMEL = 1 << 22


def _cpu_norm_by_rows(t: torch.Tensor, p: float) -> torch.Tensor:
    """The fp32 ``p``-norm of a large contiguous CPU tensor, reduced by rows (see [Note: large
    CPU norms])."""
    flat = t.reshape(-1)
    rows = flat.numel() // _NORM_ROW
    head = flat.narrow(0, 0, rows * _NORM_ROW).view(rows, _NORM_ROW)
    parts = [torch.linalg.vector_norm(head, p, dim=1, dtype=torch.float32)]
    if flat.numel() > rows * _NORM_ROW:
        tail = flat.narrow(0, rows * _NORM_ROW, flat.numel() - rows * _NORM_ROW)
        parts.append(torch.linalg.vector_norm(tail, p, dtype=torch.float32).reshape(1))
    return torch.linalg.vector_norm(torch.cat(parts).double(), p).float()


def _result_device(grads: list[torch.Tensor], group: Any) -> torch.device:
    if grads:
        return grads[0].device
    if group is not None:
        return ds_comm.group_device(group)
    return torch.device("cpu")


def global_grad_norm(
    grads_or_params: TensorsOrParams, norm_type: float | str = 2.0, group: Any = None
) -> torch.Tensor:
    """The ``norm_type``-norm of all gradients together, over the ranks of ``group``.

    Args:
        grads_or_params: gradient tensors, or parameters (their ``.grad``; None is skipped).
        norm_type: p of the p-norm (> 0), or ``inf``.
        group: None when this rank holds all the gradients; else the process group whose ranks
            each hold a disjoint shard (see [Note: which ranks a norm covers]). Every rank of the
            group must call this.

    Returns:
        A 0-dim fp32 tensor on the gradients' device, equal on every rank; inf or nan when any
        gradient holds one.

    Example:
        >>> norm = global_grad_norm(my_grad_shards, group=dp_group)  # ZeRO partitions
    """
    p = _norm_type(norm_type)
    grads = grads_of(grads_or_params)
    device = _result_device(grads, group)
    wide = torch.float32 if device.type == "mps" else torch.float64
    norms = [n.to(device, wide) for n in _per_tensor_norms(grads, p)]
    local = torch.stack(norms) if norms else torch.zeros(1, dtype=wide, device=device)
    if p == math.inf:
        local_max = local.max()
        if group is None:
            return local_max.float()
        is_nan = torch.isnan(local_max)
        packed = torch.stack([torch.where(is_nan, torch.inf, local_max), is_nan.to(wide)])
        ds_comm.all_reduce(packed, op=ds_comm.ReduceOp.MAX, group=group)
        return torch.where(packed[1] > 0, torch.nan, packed[0]).float()
    total = local.pow(p).sum()
    if group is not None:
        ds_comm.all_reduce(total, group=group)
    return total.pow(1.0 / p).float()


def clip_grad_norm_(
    parameters: TensorsOrParams,
    max_norm: float,
    norm_type: float | str = 2.0,
    group: Any = None,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale gradients in place so that their global norm is at most ``max_norm``.

    Gradients are multiplied by ``min(1, max_norm / (norm + 1e-6))`` (torch's and DeepSpeed's
    rule). A non-finite norm leaves them untouched (the step is skipped by the loss scaler)
    unless ``error_if_nonfinite``. No host synchronisation unless ``error_if_nonfinite``.

    Args:
        parameters: parameters (their ``.grad``) or gradient tensors, possibly shards.
        max_norm: the largest norm allowed.
        norm_type: p of the p-norm (> 0), or ``inf``.
        group: as in :func:`global_grad_norm`.
        error_if_nonfinite: raise RuntimeError when the norm is inf or nan.

    Returns:
        The norm before clipping (a 0-dim fp32 tensor).

    Example:
        >>> norm = clip_grad_norm_(model.parameters(), max_norm=1.0)
    """
    if not (isinstance(max_norm, (int, float)) and math.isfinite(max_norm) and max_norm > 0):
        raise ValueError(f"max_norm = {max_norm!r}: expected a positive finite number")
    grads = grads_of(parameters)
    total = global_grad_norm(grads, norm_type, group)
    finite = torch.isfinite(total)
    if error_if_nonfinite and not bool(finite):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is {float(total)}; pass "
            "error_if_nonfinite=False to leave such gradients unclipped"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    coef = torch.where(finite, coef, torch.ones_like(coef))
    buckets: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        buckets[g.device].append(g)
    for device, tensors in buckets.items():
        torch._foreach_mul_(tensors, coef.to(device))
    return total
