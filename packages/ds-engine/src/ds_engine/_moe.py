"""Models with ds-moe ``MoE`` layers under the engine: expert process groups, optimizer param
groups and checkpoint files.

[Note: MoE under the engine]
As DeepSpeed's engine does, the engine creates the expert-parallel and expert-data-parallel
process groups of every MoE layer (``ds_moe.configure_expert_parallelism``), puts expert
parameters in their own optimizer param groups (``split_params_into_different_moe_groups_for_
optimizer``; a client optimizer must already have them apart) and hands ds-zero, per param
group, the process group it is reduced and sharded over: the data-parallel group for dense
parameters, the expert-data-parallel group for experts of ``ep_size_<n>``. Gradients of both are
divided by the data-parallel size. A group of one rank (``ep_size`` equal to the data-parallel
size) is a one-rank process group, created collectively once. Checkpoints keep DeepSpeed's
layout: the model file holds the dense weights, each expert goes to its own
``layer_<L>_expert_<E>_mp_rank_<mp>_model_states.pt`` (written by the first rank of its
expert-data-parallel group), so a model saved with one ``ep_size`` loads with another.

Under ZeRO stage 3 the experts are partitioned over their expert-data-parallel group (ds-zero's
[Note: stage 3 param groups with their own process group]); the expert files are written from
the gathered experts, and the ZeRO shards name every expert parameter by its global expert id
(``ds_moe.global_expert_names``), so the sharded checkpoint (weights and optimizer state)
reshards across ``ep_size`` and world size too.

ds-moe is optional: a model can only hold ``MoE`` layers if ``ds_moe`` was imported, so the
engine looks for it in ``sys.modules`` and never imports it itself.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import ds_comm
from ds_engine.api import ConfigError
from ds_zero import GatheredParameters

__all__ = [
    "checkpoint_names_of",
    "configure_experts",
    "load_module_state",
    "module_state",
    "moe_param_groups",
    "process_groups_of",
    "save_expert_files",
]


def configure_experts(model: nn.Module, mpu: Any) -> Any:
    """The ``ds_moe.ExpertParallelGroups`` of ``model``'s MoE layers (None without any)."""
    ds_moe = sys.modules.get("ds_moe")
    if ds_moe is None or not ds_moe.has_moe_layers(model)[0]:
        return None
    grid = ds_comm.ParallelGrid.of(mpu)
    if grid is not None:  # the engine's one grid: ep/edp laid out (and reused) from it
        groups = ds_moe.ExpertParallelGroups(grid=grid)
        return ds_moe.configure_expert_parallelism(model, groups=groups)
    return ds_moe.configure_expert_parallelism(model, mpu=mpu)


def moe_param_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """``params`` (tensors or param-group dicts) with expert parameters in their own groups."""
    items = list(params)
    groups = items if items and isinstance(items[0], dict) else [{"params": items}]
    split = sys.modules["ds_moe"].split_params_into_different_moe_groups_for_optimizer
    return [g for g in split(groups) if g["params"]]


def _group_name(param: torch.Tensor) -> str | None:
    return (
        getattr(param, "group_name", None) if getattr(param, "allreduce", True) is False else None
    )


def process_groups_of(optimizer: torch.optim.Optimizer, expert_groups: Any) -> list[Any] | None:
    """ds-zero's ``param_group_process_groups``: per param group, the expert-data-parallel
    group of its experts or None for dense parameters (see [Note: MoE under the engine])."""
    if expert_groups is None:
        return None
    result: list[Any] = []
    singleton: list[Any] = []  # this rank's one-rank group, created when first needed
    for index, group in enumerate(optimizer.param_groups):
        names = {_group_name(p) for p in group["params"]}
        if len(names) > 1:
            raise ConfigError(
                f"optimizer param group {index} mixes dense and expert parameters (or experts "
                f"of several ep_size): {sorted(map(str, names))}; build the optimizer from "
                "ds_moe.split_params_into_different_moe_groups_for_optimizer(params)"
            )
        name = next(iter(names), None)
        result.append(None if name is None else _edp_group(expert_groups[name], singleton))
    return result


def _edp_group(group: Any, singleton: list[Any]) -> Any:
    if group.expert_data_parallel_group is not None or ds_comm.get_world_size() == 1:
        return group.expert_data_parallel_group
    # ds-moe leaves one-rank groups as None, which ds-zero would read as "the data-parallel
    # group": create the one-rank groups (collective, same order on every rank).
    if not singleton:
        groups = [ds_comm.new_group([r]) for r in range(ds_comm.get_world_size())]
        singleton.append(groups[ds_comm.get_rank()])
    return singleton[0]


def checkpoint_names_of(model: nn.Module, expert_groups: Any) -> dict[str, str] | None:
    """ds-zero's ``checkpoint_names``: each expert parameter's name under its global expert id
    (None without MoE layers); see [Note: MoE under the engine]."""
    if expert_groups is None:
        return None
    return sys.modules["ds_moe"].global_expert_names(model, expert_groups)


def module_state(model: nn.Module, state: dict[str, Any], expert_groups: Any) -> dict[str, Any]:
    """What the model file holds: without the experts when the model has MoE layers."""
    if expert_groups is None:
        return state
    experts = set(state) - set(sys.modules["ds_moe"].dense_state_dict(model))
    return {k: v for k, v in state.items() if k not in experts}


def save_expert_files(model: nn.Module, folder: Path, expert_groups: Any) -> None:
    """Write this rank's experts, one file each (collective over nothing; every rank calls)."""
    if expert_groups is None:
        return
    names = checkpoint_names_of(model, expert_groups) or {}
    experts = [p for n, p in model.named_parameters() if n in names]
    # ZeRO-3: whole while written (every rank gathers, over its expert-data-parallel group)
    with GatheredParameters([p for p in experts if hasattr(p, "ds_tensor")]):
        sys.modules["ds_moe"].save_expert_states(model, folder, expert_groups)


def load_module_state(
    model: nn.Module, folder: Path, state: dict[str, Any], expert_groups: Any, strict: bool
) -> None:
    """Load the model file's weights plus, with MoE layers, this rank's experts."""
    if expert_groups is not None:
        state = sys.modules["ds_moe"].load_expert_states(model, folder, dict(state), expert_groups)
    model.load_state_dict(state, strict=strict)
