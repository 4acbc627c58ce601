"""``ds-to-deepspeed`` for ds's pipeline and MoE checkpoints: each rank's ZeRO state, read back
whole, and handed to the DeepSpeed-layout writers.

[Note: reading ds's per-rank ZeRO state offline]
ds saves a pipeline engine's optimizer in ``pp_rank_SS_dp_rank_DD_states.pt`` and an MoE
model's in ``zero/zero_rankNNNNN.pt``; both hold a :meth:`ds_zero.ZeroOptimizer.state_dict`
(format ``ds_zero.sharded/1``): per param group its ``layout`` (units, each parameter's name,
shape and offset), the rank's fp32 ``masters`` partition and the torch optimizer's state over
it. A group of ``numel`` elements whose partition holds ``partition_numel`` is split over
``numel / partition_numel`` ranks; the rank at position ``p`` of the group's process group holds
``[p * s, (p + 1) * s)`` of each unit (``s`` its padded size over the ranks) at ``shard_start``
in the partition. A dense group's position is the rank; an MoE expert group (``ep_size_<E>``)
is split over the expert-data-parallel group, position ``rank // E``, and holds the experts of
expert-parallel rank ``rank % E`` under local ids (global id ``(rank % E) * local + id``).
Replicated groups (ZeRO stage 0) are read from every rank; the copies are equal.

A group's members are put in module order: a pipeline stage's parameters by layer index, then
by their order in the layer file; an MoE model's dense parameters in the model file's module
order, its experts by layer, expert id and their order in the expert file.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ds_engine._deepspeed_ckpt import DeepSpeedCheckpointError
from ds_engine._deepspeed_ckpt._pickle import save_file
from ds_engine._deepspeed_ckpt._write import model_states, write_optimizer_files
from ds_engine._deepspeed_ckpt._write_moe import (
    MoELayer,
    MoEState,
    MoETemplate,
    assemble_pieces,
    write_moe_layout,
)
from ds_engine._deepspeed_ckpt._write_pipe import check_pipeline_target
from ds_engine._deepspeed_ckpt._write_stage0 import stage0_optimizer
from ds_engine._deepspeed_ckpt._write_state import GroupState, WriteState

__all__ = ["convert_moe", "convert_pipeline", "is_moe", "is_pipeline", "read_moe"]

_FORMAT = "ds_zero.sharded/1"
_PP_STATE = re.compile(r"^pp_rank_(\d+)_dp_rank_(\d+)_states\.pt$")
_LAYER = re.compile(r"^layer_(\d+)-model_states\.pt$")
_EXPERT_FILE = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_00_model_states\.pt$")
_EXPERT_KEY = re.compile(r"^(?P<prefix>.*deepspeed_experts\.)(?P<id>\d+)\.(?P<suffix>.+)$")
_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}
_BIG = 1 << 40  # expert positions come after every dense one (groups never mix them)


def is_pipeline(folder: Path) -> bool:
    """Whether ``folder`` is a ds pipeline checkpoint (``pp_rank_*_dp_rank_*_states.pt``)."""
    return any(_PP_STATE.match(p.name) for p in folder.iterdir())


def is_moe(folder: Path) -> bool:
    """Whether ``folder`` is a ds MoE checkpoint (expert files)."""
    return any(_EXPERT_FILE.match(p.name) for p in folder.iterdir())


def _load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # unreadable or not a weights-only pickle: name the file
        raise DeepSpeedCheckpointError(f"{str(path)!r} cannot be read: {exc}") from exc


def _zero_state(state: Any, path: Path) -> Mapping[str, Any]:
    if not isinstance(state, Mapping) or state.get("format") != _FORMAT:
        raise DeepSpeedCheckpointError(
            f"{str(path)!r} holds no ds ZeRO optimizer state (format {_FORMAT!r}): converting "
            "needs ds's ZeRO optimizer (stages 0-2)"
        )
    return state


def _pieces(
    state: Mapping[str, Any], position: Callable[[int], int], rename: Callable[[str], str]
) -> list[tuple[str, int, int, int, dict[str, torch.Tensor]]]:
    """``(name, numel, start, stop, values)`` of every range this rank's state holds (see
    [Note: reading ds's per-rank ZeRO state offline])."""
    out = []
    optimizer = state["optimizer"]
    for g, (layout, master) in enumerate(zip(state["layout"], state["masters"])):
        shards = max(1, int(layout["numel"]) // max(1, int(layout["partition_numel"])))
        pos = position(g) if shards > 1 else 0
        index = optimizer["param_groups"][g]["params"][0]
        moments = {
            k: v
            for k, v in optimizer["state"].get(index, {}).items()
            if torch.is_tensor(v) and v.dim() == 1 and v.numel() == master.numel()
        }
        values = {"param": master, **moments}
        for unit in layout["units"]:
            size = int(unit["padded_numel"]) // shards
            low = pos * size
            for name, shape, offset in unit["params"]:
                numel = 1
                for d in shape:
                    numel *= int(d)
                begin, end = max(low, offset), min(low + size, offset + numel)
                if begin >= end:
                    continue
                at = int(unit["shard_start"]) + begin - low
                piece = {k: v[at : at + end - begin].float().clone() for k, v in values.items()}
                out.append((rename(name), numel, begin - offset, end - offset, piece))
    return out


def _group(saved: Mapping[str, Any], g: int) -> tuple[dict[str, Any], torch.Tensor | None]:
    """Param group ``g``'s hyper-parameters and ``step``."""
    group = saved["optimizer"]["param_groups"][g]
    step = saved["optimizer"]["state"].get(group["params"][0], {}).get("step")
    step = None if step is None else torch.as_tensor(step, dtype=torch.float32).clone()
    return {k: v for k, v in group.items() if k != "params"}, step


def _layout_names(layout: Mapping[str, Any]) -> list[tuple[str, list[int]]]:
    return [(p[0], list(p[1])) for unit in layout["units"] for p in unit["params"]]


def _meta(saved: Mapping[str, Any], config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The model file's run-level entries from ds's saved counters and scheduler."""
    scheduler = saved.get("lr_scheduler")
    if isinstance(scheduler, dict) and "last_batch_iteration" in scheduler:
        scheduler = {"last_batch_iteration": scheduler["last_batch_iteration"]}
    steps = int(saved.get("global_steps", 0))
    samples = saved.get("global_samples")
    if samples is None and config and "train_batch_size" in config:
        samples = steps * int(config["train_batch_size"])
    return {
        "buffer_names": list(saved.get("buffer_names", [])),
        "lr_scheduler": scheduler,
        "skipped_steps": int(saved.get("skipped_steps", 0)),
        "global_steps": steps,
        "global_samples": int(samples if samples is not None else 0),
        "ds_config": dict(config or {}),
    }


# --- pipelines -----------------------------------------------------------------------------


def _stage_files(folder: Path) -> dict[int, list[Path]]:
    files: dict[int, dict[int, Path]] = {}
    for p in folder.iterdir():
        if m := _PP_STATE.match(p.name):
            files.setdefault(int(m[1]), {})[int(m[2])] = p
    out = {}
    for stage, by_dp in sorted(files.items()):
        if sorted(by_dp) != list(range(len(by_dp))):
            raise DeepSpeedCheckpointError(
                f"{str(folder)!r}: pipeline stage {stage} has state files of data-parallel ranks "
                f"{sorted(by_dp)}: some are missing"
            )
        out[stage] = [by_dp[d] for d in range(len(by_dp))]
    if sorted(out) != list(range(len(out))):
        raise DeepSpeedCheckpointError(
            f"{str(folder)!r}: pipeline stages {sorted(out)} missing some"
        )
    return out


def _layer_keys(folder: Path) -> dict[int, list[str]]:
    """Each layer file's keys, in order, by layer index."""
    return {
        int(m[1]): list(_load(p)) for p in sorted(folder.iterdir()) if (m := _LAYER.match(p.name))
    }


def _layer_order(name: str, layers: Mapping[int, list[str]], folder: Path) -> tuple[int, int]:
    index, _, key = name.partition(".")
    if not index.isdigit() or key not in layers.get(int(index), []):
        raise DeepSpeedCheckpointError(
            f"{str(folder)!r}: pipeline parameter {name!r} is not '<layer>.<key>' of a "
            "layer_LL-model_states.pt file (tied modules are not converted offline; call "
            "save_deepspeed_checkpoint on the pipeline engine)"
        )
    return int(index), layers[int(index)].index(key)


def _stage_state(
    folder: Path, files: list[Path], layers: Mapping[int, list[str]], clip: float | None, scaler
) -> tuple[WriteState, Mapping[str, Any], str | None]:
    saved = [_load(f) for f in files]
    zero = [_zero_state(s.get("optimizer"), f) for s, f in zip(saved, files)]
    pieces = [p for z in zero for p in _pieces(z, lambda g, z=z: int(z["rank"]), str)]
    whole = assemble_pieces(pieces)
    groups, shapes = [], OrderedDict()
    for g, layout in enumerate(zero[0]["layout"]):
        named = _layout_names(layout)
        named.sort(key=lambda item: _layer_order(item[0], layers, folder))
        hyper, step = _group(zero[0], g)
        groups.append(GroupState([n for n, _ in named], hyper, step))
        shapes.update((n, torch.Size(s)) for n, s in named)
    state_scaler, cur_iter = scaler(zero[0].get("loss_scaler"))
    state = WriteState(
        fp32={n: v["param"] for n, v in whole.items()},
        moments={n: {k: t for k, t in v.items() if k != "param"} for n, v in whole.items()},
        shapes=shapes,
        groups=groups,
        scaler=state_scaler,
        cur_iter=int(cur_iter if cur_iter is not None else saved[0].get("global_steps", 0)),
        clip=clip,
    )
    return state, saved[0], _DTYPES.get(str(zero[0].get("dtype")))


def convert_pipeline(
    folder: Path,
    root: Path,
    *,
    world: int | None,
    stage: int | None,
    config: Mapping[str, Any] | None,
    clip: float | None,
    scaler: Callable[[Any], tuple[Any, int | None]],
) -> None:
    """Write the ds pipeline checkpoint ``folder`` in DeepSpeed's pipeline layout under the tag
    folder ``root`` (see [Note: DeepSpeed's pipeline checkpoint])."""
    stages = _stage_files(folder)
    layers = _layer_keys(folder)
    root.mkdir(parents=True, exist_ok=True)
    for index in layers:
        name = f"layer_{index:02d}-model_states.pt"
        save_file(_load(folder / name), root / name)
    for stage_id, files in stages.items():
        state, saved, dtype = _stage_state(folder, files, layers, clip, scaler)
        target = int(stage if stage is not None else saved["optimizer"].get("stage") or 0)
        check_pipeline_target(target, dtype)
        dp = int(world or len(files))
        meta = _meta(saved, config)
        trainable = set(state.shapes)
        meta["buffer_names"] = [
            f"{i}.{k}"
            for i in sorted({int(n.split(".", 1)[0]) for n in trainable})
            for k in layers[i]
            if f"{i}.{k}" not in trainable
        ]
        optimizer = stage0_optimizer(state, dtype is not None) if target == 0 else None
        states = model_states(
            meta,
            state,
            module=None,
            optimizer=optimizer,
            world=dp,
            stage=target,
            mp_world=len(stages),
            pp_degree=len(stages),
            client_state=dict(saved.get("client_state") or {}),
        )
        write_optimizer_files(
            root, state, world=dp, stage=target, bf16=dtype == "bf16", mp_rank=stage_id
        )
        save_file(states, root / f"mp_rank_{stage_id:02d}_model_states.pt")


# --- MoE -----------------------------------------------------------------------------------


def _expert_layers(
    folder: Path,
) -> tuple[list[tuple[str, int, list[str]]], dict[str, torch.Tensor]]:
    """Per MoE layer (``layer_L`` order): its experts' prefix, count and one expert's keys; and
    every expert's weights by global name."""
    by_layer: dict[int, dict[int, Path]] = {}
    for p in folder.iterdir():
        if m := _EXPERT_FILE.match(p.name):
            by_layer.setdefault(int(m[1]), {})[int(m[2])] = p
    layers, weights = [], {}
    for layer_id in sorted(by_layer):
        files = by_layer[layer_id]
        if sorted(files) != list(range(len(files))):
            raise DeepSpeedCheckpointError(
                f"{str(folder)!r}: MoE layer {layer_id} has expert files {sorted(files)}: some "
                "are missing"
            )
        prefix, suffixes = None, []
        for expert in range(len(files)):
            state = _load(files[expert])
            for key, value in state.items():
                m = _EXPERT_KEY.match(key)
                if m is None or int(m["id"]) != expert:
                    raise DeepSpeedCheckpointError(
                        f"{str(files[expert])!r}: key {key!r} does not name expert {expert}"
                    )
                prefix = m["prefix"]
                if expert == 0:
                    suffixes.append(m["suffix"])
                weights[key] = value
        layers.append((str(prefix), len(files), suffixes))
    return layers, weights


def _moe_rank_states(folder: Path) -> list[Mapping[str, Any]]:
    zero = folder / "zero"
    meta_file = zero / "metadata.json"
    if not meta_file.is_file() and (zero / "manifest.json").is_file():
        raise DeepSpeedCheckpointError(
            f"{str(folder)!r} is a ds MoE checkpoint saved at ZeRO stage 3: its shards name "
            "experts by global id but do not record which MoE layer has which ep_size, so it is "
            "not converted offline; call ds_engine.deepspeed_checkpoint.save_deepspeed_checkpoint "
            "on the engine that loads it (any ds stage; DeepSpeed's stages 0-2)"
        )
    if not meta_file.is_file():
        raise DeepSpeedCheckpointError(
            f"{str(folder)!r} holds MoE expert files but no zero/metadata.json: not an MoE "
            "checkpoint ds's save_checkpoint wrote at ZeRO stages 0-2"
        )
    meta = json.loads(meta_file.read_text())
    files = [zero / f for f in meta.get("files", [])]
    states = [_zero_state(_load(f), f) for f in files]
    ranks = sorted(int(s["rank"]) for s in states)
    if not states or ranks != list(range(int(meta.get("world_size", len(states))))):
        raise DeepSpeedCheckpointError(
            f"{str(meta_file)!r}: ranks {ranks} of world size {meta.get('world_size')}: some "
            "rank files are missing"
        )
    return sorted(states, key=lambda s: int(s["rank"]))


def _moe_layers(
    layers: list[tuple[str, int, list[str]]], state: Mapping[str, Any], folder: Path
) -> list[MoELayer]:
    """Each layer's ``ep_size`` and local expert count, from rank 0's layout of its group."""
    local: dict[str, set[int]] = {}
    ep: dict[str, int] = {}
    for g, layout in enumerate(state["layout"]):
        hyper, _ = _group(state, g)
        match = re.fullmatch(r"ep_size_(\d+)", str(hyper.get("name", "")))
        for name, _ in _layout_names(layout):
            m = _EXPERT_KEY.match(name)
            if m is None:
                continue
            if match is None:
                raise DeepSpeedCheckpointError(
                    f"{str(folder)!r}: the param group of expert parameter {name!r} is not named "
                    "'ep_size_<E>' (build the groups with split_params_into_different_moe_"
                    "groups_for_optimizer)"
                )
            local.setdefault(m["prefix"], set()).add(int(m["id"]))
            ep[m["prefix"]] = int(match[1])
    out = []
    for prefix, count, _ in layers:
        if prefix not in ep:
            raise DeepSpeedCheckpointError(
                f"{str(folder)!r}: MoE layer {prefix!r} has no trainable experts in the optimizer"
            )
        size = ep[prefix]
        if count % size or len(local[prefix]) != count // size:
            raise DeepSpeedCheckpointError(
                f"{str(folder)!r}: MoE layer {prefix!r} has {count} experts, {len(local[prefix])} "
                f"on rank 0, which does not fit ep_size {size}"
            )
        out.append(MoELayer(prefix, size, count, count // size, 0, 0))
    return out


def read_moe(
    folder: Path, scaler: Callable[[Any], tuple[Any, int | None]]
) -> tuple[MoEState, Mapping[str, Any], Mapping[str, Any]]:
    """A ds MoE checkpoint (ZeRO 0-2) whole: the state the MoE layout is cut from, the model
    file, and rank 0's ZeRO state (its stage, dtype and loss scaler)."""
    engine = _load(folder / "mp_rank_00_model_states.pt")
    expert_layers, expert_weights = _expert_layers(folder)
    states = _moe_rank_states(folder)
    layers = _moe_layers(expert_layers, states[0], folder)
    by_prefix = {layer.prefix: layer for layer in layers}

    def ep_of(name: str) -> tuple[MoELayer, re.Match[str]] | None:
        m = _EXPERT_KEY.match(name)
        return None if m is None else (by_prefix[m["prefix"]], m)

    pieces = []
    for s in states:
        rank = int(s["rank"])

        def position(g: int, s=s, rank=rank) -> int:
            first = _layout_names(s["layout"][g])[0][0]
            found = ep_of(first)
            return rank if found is None else rank // found[0].ep_size

        def rename(name: str, rank=rank) -> str:
            found = ep_of(name)
            if found is None:
                return name
            layer, m = found
            return (
                f"{layer.prefix}{(rank % layer.ep_size) * layer.local + int(m['id'])}.{m['suffix']}"
            )

        pieces += _pieces(s, position, rename)
    dense = OrderedDict(engine["module"])
    order = {n: i for i, n in enumerate(dense)}
    for li, (prefix, _, suffixes) in enumerate(expert_layers):
        for i in range(by_prefix[prefix].local):
            for si, suffix in enumerate(suffixes):
                order[f"{prefix}{i}.{suffix}"] = _BIG + (li << 24) + (i << 12) + si
    templates, shapes = [], {}
    for g, layout in enumerate(states[0]["layout"]):
        hyper, step = _group(states[0], g)
        named = _layout_names(layout)
        shapes.update((n, torch.Size(s)) for n, s in named)
        found = [ep_of(n) for n, _ in named]
        if all(f is None for f in found):
            templates.append(MoETemplate([n for n, _ in named], [], hyper, step))
        else:
            pairs = {(f[0], f[1]["suffix"]) for f in found if f is not None}
            ordered = sorted(pairs, key=lambda p: order[f"{p[0].prefix}0.{p[1]}"])
            templates.append(MoETemplate([], ordered, hyper, step))
    state_scaler, cur_iter = scaler(states[0].get("loss_scaler"))
    steps = int(engine.get("global_steps", 0))
    moe_state = MoEState(
        layers=layers,
        templates=templates,
        whole=assemble_pieces(pieces),
        expert_weights=expert_weights,
        dense=dense,
        shapes=shapes,
        order=order,
        header=WriteState({}, {}, OrderedDict(), [], state_scaler, cur_iter or steps, None),
    )
    return moe_state, engine, states[0]


def convert_moe(
    folder: Path,
    root: Path,
    *,
    world: int | None,
    stage: int | None,
    config: Mapping[str, Any] | None,
    clip: float | None,
    scaler: Callable[[Any], tuple[Any, int | None]],
) -> None:
    """Write the ds MoE checkpoint ``folder`` in DeepSpeed's MoE layout under the tag folder
    ``root`` (see [Note: DeepSpeed's MoE checkpoint])."""
    moe_state, engine, first = read_moe(folder, scaler)
    h = moe_state.header
    moe_state.header = WriteState({}, {}, OrderedDict(), [], h.scaler, h.cur_iter, clip)
    states = [first]
    target = int(stage if stage is not None else states[0].get("stage") or 0)
    write_moe_layout(
        root,
        moe_state,
        _meta(engine, config),
        world=int(world or engine.get("dp_world_size") or 1),
        stage=target,
        dtype=_DTYPES.get(str(states[0].get("dtype"))),
        client=dict(engine.get("client_state") or {}),
    )
