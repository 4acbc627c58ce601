"""DeepSpeed's checkpoint directories, read into whole per-parameter tensors.

[Note: DeepSpeed's checkpoint layout]
DeepSpeed 0.16-0.19 writes ``<dir>/latest`` (the tag, as text) and ``<dir>/<tag>/``:

- ``mp_rank_00_model_states.pt`` (stages 0-2) or one ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``
  per rank (stage 3, whose ``module`` holds empty placeholders): the module's weights in the
  model dtype, ``param_shapes`` (per param group, name -> shape, in flattening order), the
  ``lr_scheduler`` state, ``global_steps``/``global_samples``/``skipped_steps``,
  ``dp_world_size`` and the client state as extra top-level keys. At stage 0 ``optimizer``
  holds the optimizer: a torch state dict (fp32), or DeepSpeed's fp16/bf16 wrapper's
  (``fp32_groups``: per group, per parameter fp32 masters; ``optimizer_state_dict``;
  ``cur_scale`` ...).
- ``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank (stages 1-3):
  ``optimizer_state_dict`` with the loss scaler and, at stages 1-2,
  ``single_partition_of_fp32_groups`` (rank r's slice of each group's flattened fp32 masters;
  the flat group is padded at its end to a multiple of ``2 * world_size`` and the padding is
  cut off the last rank's slice, ``group_paddings``) and ``base_optimizer_state`` (the torch
  optimizer's state over those slices, padded); at stage 3 ``fp32_flat_groups`` (rank r's
  slice of every parameter, each parameter padded to a multiple of the world size, back to
  back) and ``optimizer_state_dict`` (over those flat groups).

Reading concatenates the ranks' slices and walks ``param_shapes`` in order (each parameter's
``numel`` elements), which gives every parameter's whole fp32 master and Adam moments; every
rank of the loading job reads every file, so the target world size and stage are free.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ds_engine._deepspeed_ckpt._pickle import DeepSpeedCheckpointError, load_file
from ds_engine._deepspeed_ckpt._read_moe import read_moe_optimizer

__all__ = ["DeepSpeedState", "deepspeed_tag_dir", "is_deepspeed_checkpoint", "read_checkpoint"]

_MODEL = "mp_rank_00_model_states.pt"
_ZERO_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_ZERO3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
_DS_OWN = re.compile(
    r"^(rng_state_rank\d+\.pt|zero|zero_mp\d+|pp_rank_\d+_dp_rank_\d+_states\.pt|.*manifest.*)$"
)
_LAYER_INDEX = re.compile(r"^layer_(\d+)-model_states\.pt$")
_EXPERT = re.compile(r"^(layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt$")
# Keys of the model file that DeepSpeed owns; every other top-level key is the client state.
ENGINE_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "checkpoint_parallel_dimensions",
        "ds_config",
        "ds_version",
        "num_experts",
        "ds_autoep_layers",
        "universal_checkpoint_info",
    }
)
_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class DeepSpeedState:
    """A DeepSpeed checkpoint, whole: what a loader of any world size and stage needs.

    Attributes:
        path: the tag directory.
        model_file: the model-states file the engine state came from (for messages).
        stage: the ZeRO stage that wrote it.
        world_size: its data-parallel world size.
        module: the module's state dict (stage 3: completed from the fp32 masters).
        fp32: each trainable parameter's fp32 master, flattened, by name.
        moments: each trainable parameter's elementwise optimizer state (``exp_avg``, ...).
        groups: per param group, ``{"names": [...], "hyper": {...}, "step": value}``.
        loss_scaler: the loss scaler's attributes (``cur_scale``, ``dynamic``, ...), or None.
        engine: the model file's engine entries (``global_steps``, ``lr_scheduler``, ...).
        client_state: the model file's other top-level keys.
        experts: MoE expert files (``layer_<L>_expert_<E>_mp_rank_00_model_states.pt``); with
            them, ``fp32`` and ``moments`` name experts by global id (see [Note: DeepSpeed's
            MoE optimizer files]).
        expert_optimizer_files: MoE optimizer files of stage 0 (``expp_rank_<e>_...``).
    """

    path: Path
    model_file: Path
    stage: int
    world_size: int
    module: dict[str, torch.Tensor]
    fp32: dict[str, torch.Tensor] = field(default_factory=dict)
    moments: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    groups: list[dict[str, Any]] = field(default_factory=list)
    loss_scaler: dict[str, Any] | None = None
    engine: dict[str, Any] = field(default_factory=dict)
    client_state: dict[str, Any] = field(default_factory=dict)
    experts: list[str] = field(default_factory=list)
    expert_optimizer_files: list[str] = field(default_factory=list)


def deepspeed_tag_dir(load_dir: str | os.PathLike[str], tag: str | None) -> Path | None:
    """The tag directory under ``load_dir`` when DeepSpeed wrote it, else None (``tag`` None:
    the tag ``latest`` names, read as text, never unpickled). A DeepSpeed tag must name a
    directory directly inside ``load_dir``: ``..`` or a path separator is an error."""
    root = Path(load_dir)
    if tag is None:
        latest = root / "latest"
        if not latest.is_file():
            return None
        tag = latest.read_text(errors="replace").strip()
        where = f"{str(latest)!r} names tag {tag!r}"
    else:
        where = f"tag {tag!r}"
    tag = str(tag)
    path = root / tag
    if not is_deepspeed_checkpoint(path):
        return None
    if not tag or "/" in tag or "\\" in tag or tag in (".", "..") or "\0" in tag:
        raise DeepSpeedCheckpointError(
            f"{where}: a tag is a directory name inside {str(root)!r} (no path separators)"
        )
    return path


def is_deepspeed_checkpoint(path: Path) -> bool:
    """Whether the tag directory ``path`` was written by DeepSpeed rather than ds: DeepSpeed's
    model or ZeRO files are there and none of ds's own (``rng_state_rank*.pt``, ``zero/``, the
    pipeline engine's ``pp_rank_XX_dp_rank_XX_states.pt``, a ds manifest)."""
    if not path.is_dir():
        return False
    names = [p.name for p in path.iterdir()]
    if any(_DS_OWN.match(n) for n in names):
        return False
    return any(n == _MODEL or _ZERO_OPTIM.match(n) or _ZERO3_MODEL.match(n) for n in names)


def _optim_files(path: Path) -> dict[int, Path]:
    files: dict[int, Path] = {}
    for p in path.iterdir():
        match = _ZERO_OPTIM.match(p.name)
        if match:
            files[int(match.group(2))] = p
    if files and sorted(files) != list(range(len(files))):
        raise DeepSpeedCheckpointError(
            f"{str(path)!r} has ZeRO optimizer files for ranks {sorted(files)}: some are missing"
        )
    return files


def _need(mapping: Mapping[str, Any], key: str, file: Path) -> Any:
    if not isinstance(mapping, Mapping) or key not in mapping:
        raise DeepSpeedCheckpointError(
            f"DeepSpeed checkpoint file {str(file)!r} has no {key!r} entry"
        )
    return mapping[key]


def _scaler(saved: Any) -> dict[str, Any] | None:
    if saved is None:
        return None
    return dict(vars(saved)) if hasattr(saved, "__dict__") else None


def _walk(
    flat: torch.Tensor, shapes: Mapping[str, Sequence[int]], file: Path, offset: int = 0
) -> tuple[dict[str, torch.Tensor], int]:
    """Cut ``flat`` into ``shapes`` (in order) from ``offset``; the new offset."""
    out = {}
    for name, shape in shapes.items():
        numel = math.prod(shape)
        if offset + numel > flat.numel():
            raise DeepSpeedCheckpointError(
                f"{str(file)!r}: the flattened groups hold {flat.numel()} elements but "
                f"param_shapes needs more (at {name!r}, shape {tuple(shape)})"
            )
        out[name] = flat[offset : offset + numel].clone()
        offset += numel
    return out, offset


def _group_hyper(saved: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in saved.items() if k != "params"}


def _read_stage12(state: DeepSpeedState, files: dict[int, Path], shapes: list) -> None:
    sds = [_need(load_file(files[r]), "optimizer_state_dict", files[r]) for r in sorted(files)]
    for r, sd in enumerate(sds):
        pads = sd.get("param_alignment_paddings") or []
        if any(any(p) for p in pads):
            raise DeepSpeedCheckpointError(
                f"{str(files[r])!r} uses zero_optimization parameter alignment padding, which "
                "ds does not read yet; save without it"
            )
    first = sds[0]
    base = [_need(sd, "base_optimizer_state", files[r]) for r, sd in enumerate(sds)]
    for g, group_shapes in enumerate(shapes):
        parts = [
            _need(sd, "single_partition_of_fp32_groups", files[r])[g] for r, sd in enumerate(sds)
        ]
        fp32, _ = _walk(torch.cat([p.float() for p in parts]), group_shapes, files[0])
        state.fp32.update(fp32)
        saved_states = []
        for r, b in enumerate(base):
            entry = b["state"].get(g, {}) if isinstance(b, Mapping) else b[g]
            size = parts[r].numel()
            saved_states.append(
                {
                    k: v[:size] if torch.is_tensor(v) and v.dim() == 1 and v.numel() >= size else v
                    for k, v in entry.items()
                }
            )
        step = saved_states[0].get("step")
        for key in [
            k
            for k in saved_states[0]
            if k in _MOMENTS
            or (torch.is_tensor(saved_states[0][k]) and saved_states[0][k].dim() == 1)
        ]:
            flat = torch.cat([s[key].float() for s in saved_states])
            values, _ = _walk(flat, group_shapes, files[0])
            for name, value in values.items():
                state.moments.setdefault(name, {})[key] = value
        hyper = {}
        if isinstance(base[0], Mapping) and "param_groups" in base[0]:
            hyper = _group_hyper(base[0]["param_groups"][g])
        state.groups.append({"names": list(group_shapes), "hyper": hyper, "step": step})
    state.loss_scaler = _scaler(first.get("loss_scaler"))


def _read_stage3(state: DeepSpeedState, files: dict[int, Path], shapes: list) -> None:
    world = len(files)
    merged = {name: shape for group in shapes for name, shape in group.items()}
    sds = [_need(load_file(files[r]), "optimizer_state_dict", files[r]) for r in sorted(files)]
    flats, inner = [], []
    for r, sd in enumerate(sds):
        flats.append(torch.cat([t.float() for t in _need(sd, "fp32_flat_groups", files[r])]))
        inner.append(_need(sd, "optimizer_state_dict", files[r]))
    keys = [
        k for k, v in inner[0]["state"].get(0, {}).items() if torch.is_tensor(v) and v.dim() == 1
    ]
    per_rank = {
        key: [torch.cat([s[key].float() for _, s in sorted(opt["state"].items())]) for opt in inner]
        for key in keys
    }
    offset = 0
    for name, shape in merged.items():
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        if offset + part > flats[0].numel():
            raise DeepSpeedCheckpointError(
                f"{str(files[0])!r}: fp32_flat_groups hold {flats[0].numel()} elements, fewer "
                f"than param_shapes needs (at {name!r})"
            )
        state.fp32[name] = torch.cat([f[offset : offset + part] for f in flats])[:numel].clone()
        for key, ranks in per_rank.items():
            value = torch.cat([t[offset : offset + part] for t in ranks])[:numel].clone()
            state.moments.setdefault(name, {})[key] = value
        offset += part
    step = inner[0]["state"].get(0, {}).get("step")
    groups = inner[0].get("param_groups", [])
    for g, group_shapes in enumerate(shapes):
        hyper = _group_hyper(groups[g]) if g < len(groups) else {}
        state.groups.append({"names": list(group_shapes), "hyper": hyper, "step": step})
    state.loss_scaler = _scaler(sds[0].get("loss_scaler"))


def _read_stage0(state: DeepSpeedState, model: Mapping[str, Any], names: Sequence[str]) -> None:
    """Stage 0: ``optimizer`` in the model file, state keyed by position in ``names``."""
    saved = model.get("optimizer")
    if saved is None:
        return
    wrapped = "optimizer_state_dict" in saved
    torch_sd = saved["optimizer_state_dict"] if wrapped else saved
    index = {i: n for i, n in enumerate(names)}
    masters = [t for group in saved.get("fp32_groups", []) for t in group]
    for i, name in index.items():
        source = masters[i] if wrapped and i < len(masters) else state.module.get(name)
        if source is None:
            raise DeepSpeedCheckpointError(
                f"{str(state.model_file)!r} has no weights for parameter {name!r}"
            )
        state.fp32[name] = source.float().reshape(-1).clone()
        for key, value in torch_sd["state"].get(i, {}).items():
            if torch.is_tensor(value) and value.dim() > 0:
                state.moments.setdefault(name, {})[key] = value.float().reshape(-1).clone()
    position = 0
    for group in torch_sd["param_groups"]:
        ids = list(group["params"])
        group_names = [index[i] for i in ids if i in index]
        step = next((torch_sd["state"][i].get("step") for i in ids if i in torch_sd["state"]), None)
        state.groups.append({"names": group_names, "hyper": _group_hyper(group), "step": step})
        position += len(ids)
    if position != len(names):
        raise DeepSpeedCheckpointError(
            f"{str(state.model_file)!r}: the optimizer holds {position} parameters, the model "
            f"{len(names)} trainable ones"
        )
    if wrapped:
        state.loss_scaler = {
            k: saved[k]
            for k in ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window")
            if k in saved
        } | {"dynamic": bool(saved.get("dynamic_loss_scale", False))}


def read_checkpoint(path: Path, trainable: Sequence[str]) -> DeepSpeedState:
    """Read the DeepSpeed tag directory ``path`` (see [Note: DeepSpeed's checkpoint layout]).

    Args:
        path: the tag directory.
        trainable: the loading model's trainable parameter names in optimizer order (stage 0
            checkpoints key the optimizer state by position).

    Raises:
        DeepSpeedCheckpointError: a missing or inconsistent file, named; tensor-parallel
            pipeline layer files, which ds does not read yet.
    """
    names = sorted(p.name for p in path.iterdir())
    refused = [n for n in names if re.match(r"^layer_\d+-model_\d+-model_states\.pt$", n)]
    if refused:
        raise DeepSpeedCheckpointError(
            f"{str(path)!r} holds tensor-parallel pipeline layer files ({refused[:3]}): reading "
            "those is not implemented in ds yet; consolidate the weights with DeepSpeed's "
            "zero_to_fp32 and load them with load_state_dict"
        )
    experts = [n for n in names if _EXPERT.match(n)]
    expert_optim = [n for n in names if n.startswith("expp_rank_")]
    files = _optim_files(path)
    model_file = path / _MODEL
    if not model_file.is_file():
        model_file = path / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    if not model_file.is_file():
        raise DeepSpeedCheckpointError(
            f"{str(path)!r} has neither {_MODEL!r} nor zero_pp_rank_0_mp_rank_00_model_states.pt"
        )
    model = load_file(model_file)
    if not isinstance(model, Mapping):
        raise DeepSpeedCheckpointError(f"{str(model_file)!r} does not hold a dict")
    module = dict(_need(model, "module", model_file) or {})
    module.update(_layer_weights(path, names))
    world = int(model.get("dp_world_size", len(files) or 1))
    state = DeepSpeedState(
        path=path, model_file=model_file, stage=0, world_size=world, module=module
    )
    state.engine = {k: model[k] for k in ENGINE_KEYS if k in model}
    state.client_state = {k: v for k, v in model.items() if k not in ENGINE_KEYS}
    state.experts = experts
    state.expert_optimizer_files = expert_optim
    if files and len(files) != world:
        raise DeepSpeedCheckpointError(
            f"{str(model_file)!r} says dp_world_size {world} but {str(path)!r} holds "
            f"{len(files)} ZeRO optimizer files"
        )
    if experts:
        weights = dict(module)
        for name in experts:  # by global expert id; ds-moe renames them onto local experts
            saved = load_file(path / name)
            if not isinstance(saved, Mapping):
                raise DeepSpeedCheckpointError(f"{str(path / name)!r} does not hold a state dict")
            weights.update(saved)
        read_moe_optimizer(state, files, model, weights, trainable)
    elif files:
        shapes = _need(model, "param_shapes", model_file)
        probe = load_file(files[0])
        inner = _need(probe, "optimizer_state_dict", files[0])
        stage3 = "fp32_flat_groups" in inner
        state.stage = 3 if stage3 else int(inner.get("zero_stage", 2) or 2)
        (_read_stage3 if stage3 else _read_stage12)(state, files, list(shapes))
    else:
        _read_stage0(state, model, trainable)
    for name, value in state.fp32.items():
        if name in module and module[name].numel() == 0:  # stage 3 placeholders
            module[name] = value.view(_shape_of(state, name)).to(module[name].dtype)
    return state


def _layer_weights(path: Path, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """A pipeline's weights: ``layer_XX-model_states.pt`` holds layer XX's state dict, whose
    keys take the prefix ``XX.`` in the ``PipelineModule`` (DeepSpeed's and ds's naming)."""
    weights: dict[str, torch.Tensor] = {}
    for name in names:
        match = _LAYER_INDEX.match(name)
        if match is None:
            continue
        layer = load_file(path / name)
        if not isinstance(layer, Mapping):
            raise DeepSpeedCheckpointError(f"{str(path / name)!r} does not hold a state dict")
        index = int(match.group(1))
        weights.update({f"{index}.{key}": value for key, value in layer.items()})
    return weights


def _shape_of(state: DeepSpeedState, name: str) -> tuple[int, ...]:
    for group in state.engine.get("param_shapes") or []:
        if name in group:
            return tuple(group[name])
    return (state.fp32[name].numel(),)
