"""Telling expert parameters from dense ones, and separate optimizer param groups for them.

Expert parameters carry DeepSpeed's tags (``allreduce = False``, ``group_name = "ep_size_<n>"``,
set by :class:`~ds_moe.Experts`); optimizers and ZeRO keep them in their own param groups
(``"moe": True``) because their gradients are reduced over a different process group.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ds_moe._layer import MoE

__all__ = [
    "has_moe_layers",
    "is_moe_param",
    "is_moe_param_group",
    "split_params_grads_into_shared_and_expert_params",
    "split_params_into_different_moe_groups_for_optimizer",
    "split_params_into_shared_and_expert_params",
]

# DeepSpeed's default: about 180M elements per expert param group.
_MAX_GROUP_SIZE = 178956971


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to an expert (reduced over its expert-data-parallel group)."""
    return getattr(param, "allreduce", True) is False


def has_moe_layers(model: nn.Module) -> tuple[bool, int]:
    """``(True, num_experts of the first MoE layer)``, or ``(False, 0)`` without MoE layers."""
    for module in model.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def split_params_into_shared_and_expert_params(
    params: Iterable[nn.Parameter],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(dense params, expert params)``, each in the given order."""
    shared: list[nn.Parameter] = []
    expert: list[nn.Parameter] = []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_grads_into_shared_and_expert_params(
    group: Iterable[nn.Parameter],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(dense grads, expert grads)`` of the params that have one, cast to the param dtype.

    Used for gradient norms: expert norms are reduced over a different group than dense ones.
    """
    shared: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    for p in group:
        if p.grad is not None:
            (expert if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, expert


def is_moe_param_group(param_group: Mapping[str, Any]) -> bool:
    """Whether an optimizer param group holds expert parameters (``"moe": True``)."""
    return bool(param_group.get("moe", False))


def _chunks(params: Sequence[nn.Parameter], max_numel: int | None) -> list[list[nn.Parameter]]:
    if max_numel is None:
        return [list(params)] if params else []
    chunks: list[list[nn.Parameter]] = []
    current: list[nn.Parameter] = []
    size = 0
    for p in params:
        if current and size + p.numel() > max_numel:
            chunks.append(current)
            current, size = [], 0
        current.append(p)
        size += p.numel()
    if current:
        chunks.append(current)
    return chunks


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    max_group_size: int | None = _MAX_GROUP_SIZE,
) -> list[dict[str, Any]]:
    """Move expert parameters into their own optimizer param groups (DeepSpeed's function).

    Each input group keeps its dense parameters; for each input group and each expert
    ``group_name`` found, a copy of the group's options with ``"name": group_name``,
    ``"moe": True`` and that group's expert parameters is appended, split into chunks of at most
    ``max_group_size`` elements (None: no split). Input dicts are not modified.

    Args:
        param_groups: one param group dict or a list/tuple of them (``"params"`` required).
        max_group_size: largest number of elements per expert param group.

    Returns:
        The dense groups (in input order) followed by the expert groups.

    Example:
        >>> groups = split_params_into_different_moe_groups_for_optimizer(
        ...     {"params": list(model.parameters()), "name": "dense", "lr": 1e-3}
        ... )
        >>> torch.optim.AdamW(groups)
    """
    if isinstance(param_groups, Mapping):
        param_groups = [param_groups]
    elif not isinstance(param_groups, Sequence):
        raise TypeError(
            f"param_groups must be a dict or a list of dicts, got {type(param_groups).__name__}"
        )
    dense_groups: list[dict[str, Any]] = []
    expert_groups: list[dict[str, Any]] = []
    for source in param_groups:
        dense, by_name = [], {}
        for p in source["params"]:
            if is_moe_param(p):
                by_name.setdefault(p.group_name, []).append(p)
            else:
                dense.append(p)
        dense_groups.append({**source, "params": dense})
        for name, params in by_name.items():
            for chunk in _chunks(params, max_group_size):
                expert_groups.append({**source, "name": name, "moe": True, "params": chunk})
    return dense_groups + expert_groups
