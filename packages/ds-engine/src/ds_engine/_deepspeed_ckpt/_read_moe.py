"""The optimizer state of a DeepSpeed MoE checkpoint, keyed by global expert ids.

[Note: DeepSpeed's MoE optimizer files]
A DeepSpeed MoE model puts its expert parameters in their own optimizer param groups (one per
``ep_size``, ``{"name": "ep_size_<E>", "moe": True}``, after the dense groups; made by
``split_params_into_different_moe_groups_for_optimizer``). Rank ``r`` holds the experts of
expert-parallel rank ``e = r % E`` under local ids ``0 .. L-1`` (``L = num_experts / E``),
whose global ids are ``e * L + local``. DeepSpeed 0.16-0.19 saves:

- stage 0: ``expp_rank_<e>_mp_rank_00_optim_states.pt`` per expert-parallel rank,
  ``{"optimizer": state_dict}`` of that rank's optimizer (dense parameters, equal in every
  file, and its own experts), keyed by position in the param groups;
- stages 1-2: one ZeRO file per data-parallel rank, as without experts, except that an expert
  group is flattened per rank (its own experts) and partitioned over the expert-data-parallel
  group (ranks ``e, e + E, ...``), and ``param_shapes`` (written by rank 0) name rank 0's
  local experts.

Reading renames every expert entry to its global id (``...deepspeed_experts.<global>.<rest>``),
so a loader with another ``ep_size`` asks for the experts it holds by their global ids.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ds_engine._deepspeed_ckpt._pickle import DeepSpeedCheckpointError, load_file

if TYPE_CHECKING:
    from ds_engine._deepspeed_ckpt._read import DeepSpeedState

__all__ = ["EXPERT_PARAM", "read_moe_optimizer"]

EXPERT_PARAM = re.compile(r"^(?P<prefix>.*deepspeed_experts\.)(?P<id>\d+)\.(?P<suffix>.+)$")
_EXPP = re.compile(r"^expp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_NOT_HYPER = frozenset({"params", "name", "moe"})  # the group's identity, not its settings


def _layers(trainable: Sequence[str]) -> dict[str, list[str]]:
    """Per MoE layer (its experts' prefix, in model order), one expert's parameter suffixes."""
    layers: dict[str, list[str]] = {}
    first: dict[str, str] = {}
    for name in trainable:
        match = EXPERT_PARAM.match(name)
        if match is None:
            continue
        prefix = match["prefix"]
        first.setdefault(prefix, match["id"])
        if match["id"] == first[prefix]:
            layers.setdefault(prefix, []).append(match["suffix"])
    return layers


def _expert_names(
    layers: Mapping[str, list[str]], num_experts: Sequence[int], ep_size: int, ep_rank: int
) -> list[str]:
    """The global names of expert-parallel rank ``ep_rank``'s experts, in DeepSpeed's order."""
    names = []
    for (prefix, suffixes), count in zip(layers.items(), num_experts):
        local = count // ep_size
        for i in range(local):
            names += [f"{prefix}{ep_rank * local + i}.{s}" for s in suffixes]
    return names


def _checked_layers(trainable: Sequence[str], engine: Mapping[str, Any], file: Path):
    layers = _layers(trainable)
    num_experts = list(engine.get("num_experts") or [])
    if len(num_experts) != len(layers):
        raise DeepSpeedCheckpointError(
            f"{str(file)!r} records {len(num_experts)} MoE layers (num_experts {num_experts}), "
            f"the model has {len(layers)}"
        )
    return layers, num_experts


def _hyper(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in _NOT_HYPER}


def _group_names(
    groups: Sequence[Mapping[str, Any]], dense: list[str], experts: list[str], file: Path
) -> list[list[str]]:
    """Each saved param group's parameter names: dense groups take the dense names in order,
    ``moe`` groups the expert names."""
    queues = {False: iter(dense), True: iter(experts)}
    out = []
    for group in groups:
        queue = queues[bool(group.get("moe", False))]
        names = [next(queue, None) for _ in group["params"]]
        if None in names:
            raise DeepSpeedCheckpointError(
                f"{str(file)!r}: the optimizer's param groups hold more parameters than the model "
                f"({len(dense)} dense, {len(experts)} expert parameters on this rank)"
            )
        out.append([n for n in names if n is not None])
    if next(queues[False], None) is not None or next(queues[True], None) is not None:
        raise DeepSpeedCheckpointError(
            f"{str(file)!r}: the optimizer's param groups hold fewer parameters than the model"
        )
    return out


def _expp_files(path: Path) -> dict[int, Path]:
    files = {int(m.group(1)): path / n for n in _names(path) if (m := _EXPP.match(n))}
    if sorted(files) != list(range(len(files))):
        raise DeepSpeedCheckpointError(
            f"{str(path)!r} has MoE optimizer files for expert-parallel ranks {sorted(files)}: "
            "some are missing"
        )
    return files


def _names(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def _read_stage0(
    state: DeepSpeedState, weights: Mapping[str, torch.Tensor], trainable: Sequence[str]
) -> None:
    files = _expp_files(state.path)
    if not files:
        raise DeepSpeedCheckpointError(
            f"{str(state.path)!r} holds MoE expert files but no expp_rank_*_optim_states.pt"
        )
    layers, num_experts = _checked_layers(trainable, state.engine, state.model_file)
    dense = [n for n in trainable if EXPERT_PARAM.match(n) is None]
    ep_size = len(files)
    for ep_rank, file in sorted(files.items()):
        saved = load_file(file)
        optimizer = saved.get("optimizer") if isinstance(saved, Mapping) else None
        if not isinstance(optimizer, Mapping):
            raise DeepSpeedCheckpointError(f"{str(file)!r} has no 'optimizer' state dict")
        wrapped = "optimizer_state_dict" in optimizer
        torch_sd = optimizer["optimizer_state_dict"] if wrapped else optimizer
        experts = _expert_names(layers, num_experts, ep_size, ep_rank)
        names = _group_names(torch_sd["param_groups"], dense, experts, file)
        masters = list(optimizer.get("fp32_groups", []))
        for g, (group, group_names) in enumerate(zip(torch_sd["param_groups"], names)):
            moe = bool(group.get("moe", False))
            for j, (index, name) in enumerate(zip(group["params"], group_names)):
                if not moe and ep_rank > 0:
                    continue  # the dense state is the same in every file
                source = masters[g][j] if wrapped else weights.get(name)
                if source is None:
                    raise DeepSpeedCheckpointError(f"{str(file)!r}: no weights for {name!r}")
                state.fp32[name] = source.float().reshape(-1).clone()
                for key, value in torch_sd["state"].get(index, {}).items():
                    if torch.is_tensor(value) and value.dim() > 0:
                        state.moments.setdefault(name, {})[key] = value.float().reshape(-1).clone()
            if ep_rank == 0:
                step = next(
                    (
                        torch_sd["state"][i].get("step")
                        for i in group["params"]
                        if i in torch_sd["state"]
                    ),
                    None,
                )
                state.groups.append({"names": group_names, "hyper": _hyper(group), "step": step})
        if wrapped and ep_rank == 0:
            state.loss_scaler = {
                k: optimizer[k]
                for k in (
                    "cur_scale",
                    "cur_iter",
                    "last_overflow_iter",
                    "scale_factor",
                    "scale_window",
                )
                if k in optimizer
            } | {"dynamic": bool(optimizer.get("dynamic_loss_scale", False))}


def _read_zero(
    state: DeepSpeedState,
    files: Mapping[int, Path],
    trainable: Sequence[str],
    model: Mapping[str, Any],
) -> None:
    """Stages 1-2: each rank's ZeRO file; expert groups partitioned over the expert-data-
    parallel group (see [Note: DeepSpeed's MoE optimizer files])."""
    world = len(files)
    layers, num_experts = _checked_layers(trainable, state.engine, state.model_file)
    sds: list[Mapping[str, Any]] = []
    for r in range(world):
        loaded = load_file(files[r])
        sd = loaded.get("optimizer_state_dict") if isinstance(loaded, Mapping) else None
        if not isinstance(sd, Mapping) or "single_partition_of_fp32_groups" not in sd:
            raise DeepSpeedCheckpointError(
                f"{str(files[r])!r} has no optimizer_state_dict.single_partition_of_fp32_groups "
                "(MoE is read at ZeRO stages 0-2)"
            )
        sds.append(sd)
    base = [sd["base_optimizer_state"] for sd in sds]
    param_groups = base[0]["param_groups"]
    shapes = list(model.get("param_shapes") or [])
    if len(shapes) != len(param_groups):
        raise DeepSpeedCheckpointError(
            f"{str(state.model_file)!r}: param_shapes has {len(shapes)} groups, the optimizer "
            f"{len(param_groups)}"
        )
    for g, group in enumerate(param_groups):
        moe = bool(group.get("moe", False))
        ep_size = (
            _ep_size(group, sds[0].get("partition_count"), g, world, files[0]) if moe else world
        )
        owners = (
            [list(range(e, world, ep_size)) for e in range(ep_size)]
            if moe
            else [list(range(world))]
        )
        group_shapes = list(shapes[g].values())
        for ep_rank, ranks in enumerate(owners):
            if moe:
                names = _expert_names(layers, num_experts, ep_size, ep_rank)
            else:
                names = list(shapes[g])
            if len(names) != len(group_shapes):
                raise DeepSpeedCheckpointError(
                    f"{str(state.model_file)!r}: param group {g} has {len(group_shapes)} "
                    f"parameters, the model {len(names)}"
                )
            parts = [sds[r]["single_partition_of_fp32_groups"][g] for r in ranks]
            sizes = [p.numel() for p in parts]
            _cut(
                state.fp32,
                torch.cat([p.float() for p in parts]),
                names,
                group_shapes,
                files[ranks[0]],
            )
            entries = [base[r]["state"].get(g, {}) for r in ranks]
            for key in [k for k, v in entries[0].items() if torch.is_tensor(v) and v.dim() == 1]:
                flat = torch.cat([e[key][:n].float() for e, n in zip(entries, sizes)])
                values: dict[str, torch.Tensor] = {}
                _cut(values, flat, names, group_shapes, files[ranks[0]])
                for name, value in values.items():
                    state.moments.setdefault(name, {})[key] = value
        step = base[0]["state"].get(g, {}).get("step")
        group_names = _expert_names(layers, num_experts, 1, 0) if moe else list(shapes[g])
        state.groups.append({"names": group_names, "hyper": _hyper(group), "step": step})
    state.stage = int(sds[0].get("zero_stage", 2) or 2)
    loss_scaler = sds[0].get("loss_scaler")
    state.loss_scaler = dict(vars(loss_scaler)) if hasattr(loss_scaler, "__dict__") else None


def _ep_size(group: Mapping[str, Any], counts: Any, index: int, world: int, file: Path) -> int:
    """An expert group's expert-parallel size: the world over its partition count (the
    expert-data-parallel size), else the ``ep_size_<E>`` of its name."""
    if isinstance(counts, Sequence) and index < len(counts) and int(counts[index]) > 0:
        size = world // int(counts[index])
    else:
        match = re.fullmatch(r"ep_size_(\d+)", str(group.get("name", "")))
        size = int(match.group(1)) if match else 0
    if size < 1 or world % size:
        raise DeepSpeedCheckpointError(
            f"{str(file)!r}: MoE param group {group.get('name')!r} does not name an ep_size that "
            f"divides the {world} ranks"
        )
    return size


def _cut(
    out: dict[str, torch.Tensor],
    flat: torch.Tensor,
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    file: Path,
) -> None:
    offset = 0
    for name, shape in zip(names, shapes):
        numel = math.prod(shape)
        if offset + numel > flat.numel():
            raise DeepSpeedCheckpointError(
                f"{str(file)!r}: the flattened group holds {flat.numel()} elements, fewer than "
                f"its parameters need (at {name!r})"
            )
        out[name] = flat[offset : offset + numel].clone()
        offset += numel


def read_moe_optimizer(
    state: DeepSpeedState,
    files: Mapping[int, Path],
    model: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
    trainable: Sequence[str],
) -> None:
    """Fill ``state`` (a :class:`DeepSpeedState`) with the fp32 masters, moments, param groups
    and loss scaler of a DeepSpeed MoE checkpoint (stages 0-2), expert entries under their
    global ids (see [Note: DeepSpeed's MoE optimizer files]).

    Args:
        state: the checkpoint read so far (engine entries, module).
        files: the ZeRO optimizer files by data-parallel rank (empty at stage 0).
        model: the model-states file's contents.
        weights: the dense weights and every expert's, by global name.
        trainable: the loading model's trainable parameter names (its local expert ids).
    """
    if files:
        _read_zero(state, files, trainable, model)
    else:
        _read_stage0(state, weights, trainable)
