"""Checkpoints with one file per expert, so a model saved with one ``ep_size`` loads with another.

[Note: per-expert checkpoint files]
DeepSpeed's layout: the dense state (everything but expert weights) goes to
``mp_rank_<mp>_model_states.pt`` under key ``"module"``, written by data-parallel rank 0; each
expert goes to ``layer_<L>_expert_<E>_mp_rank_<mp>_model_states.pt``, where ``L`` counts the
model's MoE layers in ``named_modules`` order and ``E`` is the *global* expert id
(``expert_parallel_rank * num_local_experts + local id``). The keys inside an expert file name it
by its global id (``...deepspeed_experts.<E>.weight``). Each expert is written by the rank of
expert-data-parallel rank 0 that holds it; on load every rank reads the files of the global
experts it holds under the new ``ep_size`` and renames them to its local ids, so resharding is
only a different choice of files.

Saving and loading are not collective: a rank that loads what others saved must wait for them
(e.g. ``ds_comm.barrier()``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import ds_comm
from ds_moe._groups import ExpertParallelGroups, moe_layers
from ds_moe._layer import MoE

__all__ = [
    "dense_state_dict",
    "expert_checkpoint_name",
    "expert_parallel_state_dict",
    "global_expert_names",
    "load_expert_states",
    "load_moe_checkpoint",
    "model_checkpoint_name",
    "save_expert_states",
    "save_moe_checkpoint",
]

_EXPERTS = "deepspeed_moe.experts.deepspeed_experts."


def expert_checkpoint_name(layer_id: int, expert_id: int, mp_rank: int = 0) -> str:
    """DeepSpeed's file name of one expert: ``layer_0_expert_5_mp_rank_00_model_states.pt``."""
    return f"layer_{layer_id}_expert_{expert_id}_mp_rank_{mp_rank:02d}_model_states.pt"


def model_checkpoint_name(mp_rank: int = 0) -> str:
    """DeepSpeed's file name of the dense model state: ``mp_rank_00_model_states.pt``."""
    return f"mp_rank_{mp_rank:02d}_model_states.pt"


def _experts_prefix(layer_name: str) -> str:
    return f"{layer_name}.{_EXPERTS}" if layer_name else _EXPERTS


def _without_experts(
    model: nn.Module, state: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    prefixes = tuple(_experts_prefix(name) for name, _ in moe_layers(model))
    return {k: v for k, v in state.items() if not k.startswith(prefixes)}


def dense_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` without the expert weights of its MoE layers."""
    return _without_experts(model, model.state_dict())


def _ranks(layer: MoE, groups: ExpertParallelGroups | None) -> tuple[int, int, int]:
    """``(expert-parallel rank, expert-data-parallel rank, model-parallel rank)`` of a layer."""
    if layer.expert_group is None and layer.ep_size > 1:
        raise RuntimeError(
            f"MoE layer with ep_size={layer.ep_size} has no expert group: call "
            "ds_moe.configure_expert_parallelism(model) before saving or loading"
        )
    mp_rank = groups.model_parallel_rank if groups is not None else 0
    if layer.expert_group is None:
        return 0, _data_parallel_rank(groups), mp_rank
    group = layer.expert_group
    return group.expert_parallel_rank, group.expert_data_parallel_rank, mp_rank


def _data_parallel_rank(groups: ExpertParallelGroups | None) -> int:
    if groups is not None:
        return groups.data_parallel_rank
    return ds_comm.get_rank() if ds_comm.is_initialized() else 0


@dataclass(frozen=True)
class _HeldExpert:
    """One expert this rank holds: where it lives in the model and in a checkpoint."""

    layer_id: int
    prefix: str  # state-dict prefix of the layer's experts, ending in "deepspeed_experts."
    local_id: int
    global_id: int
    mp_rank: int
    save: bool  # this rank writes it (expert-data-parallel rank 0)

    def local_key(self, suffix: str) -> str:
        return f"{self.prefix}{self.local_id}.{suffix}"

    def global_key(self, suffix: str) -> str:
        return f"{self.prefix}{self.global_id}.{suffix}"


def _held_experts(model: nn.Module, groups: ExpertParallelGroups | None) -> Iterator[_HeldExpert]:
    for layer_id, (name, layer) in enumerate(moe_layers(model)):
        ep_rank, edp_rank, mp_rank = _ranks(layer, groups)
        for local in range(layer.num_local_experts):
            yield _HeldExpert(
                layer_id=layer_id,
                prefix=_experts_prefix(name),
                local_id=local,
                global_id=ep_rank * layer.num_local_experts + local,
                mp_rank=mp_rank,
                save=edp_rank == 0,
            )


def _suffixes(state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}


def expert_parallel_state_dict(
    model: nn.Module,
    full_state_dict: Mapping[str, torch.Tensor],
    groups: ExpertParallelGroups | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's share of a full state dict, for ``model.load_state_dict``.

    ``full_state_dict`` names every expert by its global id, as the state dict of the same model
    built with ``ep_size=1`` does. Dense entries are kept; of the experts, only those this rank
    holds are kept, renamed to their local ids.

    Example:
        >>> full = reference_model.state_dict()  # same layers, ep_size=1
        >>> model.load_state_dict(ds_moe.expert_parallel_state_dict(model, full, groups))
    """
    state = _without_experts(model, full_state_dict)
    for held in _held_experts(model, groups):
        for suffix, value in _suffixes(full_state_dict, held.global_key("")).items():
            state[held.local_key(suffix)] = value
    return state


def global_expert_names(
    model: nn.Module, groups: ExpertParallelGroups | None = None
) -> dict[str, str]:
    """By parameter name, the name each expert parameter this rank holds has under its global
    expert id (the name in the same model built with ``ep_size=1``).

    A sharded optimizer checkpoint that names experts this way (ds-zero's stage 3 under
    ds-engine) holds one tensor per expert whatever the ``ep_size``, so it reshards across
    ``ep_size`` as the per-expert files do.

    Example:
        >>> ds_moe.global_expert_names(model, groups)  # rank 1 of ep_size=2, 4 experts
        {'moe.deepspeed_moe.experts.deepspeed_experts.0.weight':
         'moe.deepspeed_moe.experts.deepspeed_experts.2.weight', ...}
    """
    names = [name for name, _ in model.named_parameters()]
    result: dict[str, str] = {}
    for held in _held_experts(model, groups):
        prefix = held.local_key("")
        for name in names:
            if name.startswith(prefix):
                result[name] = held.global_key(name[len(prefix) :])
    return result


def save_expert_states(
    model: nn.Module, save_dir: str | Path, groups: ExpertParallelGroups | None = None
) -> list[Path]:
    """Write this rank's experts, one file each; see [Note: per-expert checkpoint files].

    Returns:
        The files written (none on ranks whose expert-data-parallel rank is not 0).
    """
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    written = []
    for held in _held_experts(model, groups):
        if not held.save:
            continue
        expert_state = {
            held.global_key(suffix): value.detach().clone()
            for suffix, value in _suffixes(state, held.local_key("")).items()
        }
        path = save_dir / expert_checkpoint_name(held.layer_id, held.global_id, held.mp_rank)
        torch.save(expert_state, path)
        written.append(path)
    return written


def load_expert_states(
    model: nn.Module,
    load_dir: str | Path,
    state_dict: dict[str, torch.Tensor],
    groups: ExpertParallelGroups | None = None,
) -> dict[str, torch.Tensor]:
    """Add the experts this rank holds (under its current ``ep_size``) to ``state_dict``.

    Reads the ``layer_<L>_expert_<E>_...`` files of this rank's global expert ids and renames
    their keys to local ids. Returns ``state_dict`` (updated in place) for ``load_state_dict``.
    """
    for held in _held_experts(model, groups):
        path = Path(load_dir) / expert_checkpoint_name(held.layer_id, held.global_id, held.mp_rank)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: no checkpoint of expert {held.global_id} of MoE layer {held.layer_id}; "
                f"was it saved from a model with the same MoE layers and num_experts?"
            )
        saved = torch.load(path, map_location="cpu", weights_only=True)
        suffixes = _suffixes(saved, held.global_key(""))
        if len(suffixes) != len(saved):
            raise ValueError(
                f"{path}: keys {sorted(saved)} do not all start with {held.global_key('')}"
            )
        for suffix, value in suffixes.items():
            state_dict[held.local_key(suffix)] = value
    return state_dict


def save_moe_checkpoint(
    model: nn.Module, save_dir: str | Path, *, groups: ExpertParallelGroups | None = None
) -> list[Path]:
    """Save ``model``: dense state by data-parallel rank 0, experts one file each.

    Call on every rank (each writes its share). See [Note: per-expert checkpoint files].

    Example:
        >>> ds_moe.save_moe_checkpoint(model, "ckpt/step100", groups=groups)
        >>> ds_comm.barrier()
        >>> ds_moe.load_moe_checkpoint(other_ep_size_model, "ckpt/step100", groups=other_groups)
    """
    written = save_expert_states(model, save_dir, groups)
    if _data_parallel_rank(groups) == 0:
        mp_rank = groups.model_parallel_rank if groups is not None else 0
        path = Path(save_dir) / model_checkpoint_name(mp_rank)
        torch.save({"module": dense_state_dict(model)}, path)
        written.append(path)
    return written


def load_moe_checkpoint(
    model: nn.Module,
    load_dir: str | Path,
    *,
    groups: ExpertParallelGroups | None = None,
    strict: bool = True,
) -> nn.modules.module._IncompatibleKeys:
    """Load what :func:`save_moe_checkpoint` wrote, whatever ``ep_size`` it was saved with.

    Returns:
        ``model.load_state_dict``'s missing and unexpected keys.
    """
    mp_rank = groups.model_parallel_rank if groups is not None else 0
    path = Path(load_dir) / model_checkpoint_name(mp_rank)
    state = torch.load(path, map_location="cpu", weights_only=True)["module"]
    return model.load_state_dict(load_expert_states(model, load_dir, state, groups), strict=strict)
