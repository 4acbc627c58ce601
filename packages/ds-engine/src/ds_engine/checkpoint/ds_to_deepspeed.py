"""``ds-to-deepspeed``: a checkpoint ds saved, rewritten in DeepSpeed's layout, offline::

    ds-to-deepspeed <ds_checkpoint_dir> <out_dir> [--tag TAG] [--world-size N] [--stage S]
        [--param-group REGEX ...] [--config ds_config.json]

``<ds_checkpoint_dir>`` is the ``save_dir`` of ``engine.save_checkpoint`` (the tag from its
``latest`` unless ``--tag``) or a tag folder; ``<out_dir>`` becomes a DeepSpeed ``save_dir``
(``<out_dir>/<tag>/`` and ``latest``) that real DeepSpeed's ``engine.load_checkpoint(out_dir)``
resumes: weights, fp32 masters, optimizer moments and steps, loss scaler, LR scheduler, step
counters and the client state (as top-level keys, where DeepSpeed keeps it). No model and no
process group are needed: everything is read from the files (see [Note: writing DeepSpeed's
layout]). The same layout is written from a live engine by
``ds_engine.deepspeed_checkpoint.save_deepspeed_checkpoint``.

- ``--world-size``: DeepSpeed's data-parallel world size (default: the one that saved). DeepSpeed
  cannot repartition a ZeRO checkpoint when it loads, so the files are cut for this size.
- ``--stage``: DeepSpeed's ZeRO stage, 0-3 (default: the one that saved).
- ``--param-group REGEX`` (repeat, in the optimizer's group order): which trainable parameters
  form each param group, a parameter joining the first group whose pattern it matches
  (``re.search``). Needed when the checkpoint has several groups; one group takes everything.
- ``--config``: the DeepSpeed config (JSON) the resumed run uses, at ``--world-size`` ranks;
  its ``gradient_clipping`` and ``fp16`` loss-scaling window and hysteresis go into the files
  and it is stored as ``ds_config``. Without it DeepSpeed keeps its own configured clipping.

Pipeline checkpoints (``pp_rank_SS_dp_rank_DD_states.pt``: every stage's files, for
``--world-size`` data-parallel ranks per stage, ZeRO stage 0 or 1) and MoE checkpoints (expert
files: DeepSpeed's MoE layout at ZeRO stage 0-2, each layer keeping its ``ep_size``; the world
size must be a multiple of every ``ep_size``) are converted too; their param groups come from
the files, so ``--param-group`` is not used (see ``_convert_layouts``). Refused, naming the
reason: a ds checkpoint without ZeRO shards, MoE to ZeRO stage 3 and pipelines to stage 2-3
(DeepSpeed runs neither), tied pipeline modules, and group patterns that leave a parameter out.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import ds_zero
from ds_engine._deepspeed_ckpt import DeepSpeedCheckpointError
from ds_engine._deepspeed_ckpt._pickle import DynamicLossScalerState, LossScalerState
from ds_engine._deepspeed_ckpt._write import write_layout
from ds_engine._deepspeed_ckpt._write_state import GroupState, WriteState
from ds_engine.api import DeepSpeedConfig
from ds_engine.checkpoint._convert_layouts import (
    convert_moe,
    convert_pipeline,
    is_moe,
    is_pipeline,
)

__all__ = ["convert_to_deepspeed", "main", "parse_arguments"]

_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The ``ds-to-deepspeed`` command line."""
    parser = argparse.ArgumentParser(
        prog="ds-to-deepspeed",
        description="Rewrite a ds checkpoint in DeepSpeed's layout (DeepSpeed's load_checkpoint "
        "resumes it).",
        allow_abbrev=False,
    )
    parser.add_argument("ds_checkpoint_dir", help="ds save_dir (or a tag folder in it)")
    parser.add_argument("out_dir", help="the DeepSpeed save_dir to write")
    parser.add_argument("--tag", default=None, help="the tag to convert (default: latest)")
    parser.add_argument("--world-size", type=int, default=None, help="DeepSpeed's DP world size")
    parser.add_argument("--stage", type=int, default=None, help="DeepSpeed's ZeRO stage (0-3)")
    parser.add_argument(
        "--param-group",
        action="append",
        default=None,
        metavar="REGEX",
        help="a param group's member pattern; repeat in group order",
    )
    parser.add_argument("--config", default=None, help="the run's DeepSpeed config (JSON)")
    return parser.parse_args(argv)


def _tag_folder(source: Path, tag: str | None) -> Path:
    if tag is not None:
        return source / tag
    if (source / "latest").is_file():
        return source / (source / "latest").read_text().strip()
    return source


def _refuse_unsupported(folder: Path) -> None:
    if not (folder / "zero" / "manifest.json").is_file():
        raise DeepSpeedCheckpointError(
            f"{str(folder)!r} has no zero/manifest.json: not a checkpoint ds's save_checkpoint "
            "wrote (pass the save_dir or its tag folder)"
        )


def _membership(names: list[str], count: int, patterns: Sequence[str] | None) -> list[list[str]]:
    if not patterns:
        if count != 1:
            raise DeepSpeedCheckpointError(
                f"the checkpoint has {count} param groups: say which parameters form each with "
                f"--param-group REGEX, {count} times in the optimizer's group order"
            )
        return [list(names)]
    if len(patterns) != count:
        raise DeepSpeedCheckpointError(
            f"--param-group given {len(patterns)} times, the checkpoint has {count} param groups"
        )
    compiled = [re.compile(p) for p in patterns]
    groups: list[list[str]] = [[] for _ in compiled]
    for name in names:
        index = next((i for i, c in enumerate(compiled) if c.search(name)), None)
        if index is None:
            raise DeepSpeedCheckpointError(
                f"parameter {name!r} matches no --param-group pattern {list(patterns)}"
            )
        groups[index].append(name)
    empty = [patterns[i] for i, g in enumerate(groups) if not g]
    if empty:
        raise DeepSpeedCheckpointError(f"--param-group patterns {empty} match no parameter")
    return groups


def _scaler(saved: Any, config: DeepSpeedConfig | None) -> tuple[LossScalerState, int | None]:
    if not saved or "cur_iter" not in saved:
        scale = float(saved["cur_scale"]) if saved else 1.0
        return LossScalerState(cur_scale=scale, dynamic=False), None
    fp16 = config.fp16 if config is not None else None
    return (
        DynamicLossScalerState(
            cur_scale=float(saved["cur_scale"]),
            dynamic=True,
            cur_iter=int(saved["cur_iter"]),
            last_overflow_iter=int(saved["last_overflow_iter"]),
            cur_hysteresis=int(saved["cur_hysteresis"]),
            dtype=torch.float16,
            scale_factor=2.0,
            scale_window=int(getattr(fp16, "loss_scale_window", 1000)),
            min_scale=float(getattr(fp16, "min_loss_scale", 1)),
            delayed_shift=int(getattr(fp16, "hysteresis", 2)),
            consecutive_hysteresis=bool(getattr(fp16, "consecutive_hysteresis", False)),
            raise_error_at_min_scale=True,
        ),
        int(saved["cur_iter"]),
    )


def _read(folder: Path, patterns: Sequence[str] | None, config: DeepSpeedConfig | None):
    """The ds checkpoint in ``folder`` as a :class:`WriteState`, its model file and its dtype."""
    engine = torch.load(
        folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True
    )
    manifest = json.loads((folder / "zero" / "manifest.json").read_text())
    view = ds_zero.CheckpointView(folder.parent, tag=folder.name)
    try:
        frozen = set(engine.get("frozen_param_shapes") or {})
        names = [n for n in view.shapes if n not in frozen]
        scalars = view.scalars()
        fp32: dict[str, torch.Tensor] = {}
        moments: dict[str, dict[str, torch.Tensor]] = {}
        module: OrderedDict[str, torch.Tensor] = OrderedDict(engine["module"])
        for name in view.shapes:
            numel = 1
            for d in view.shapes[name]:
                numel *= d
            values = view.values(name, 0, numel)
            dtype = getattr(torch, manifest["tensors"][name]["dtype"].split(".")[-1])
            if name not in module:  # a ZeRO-3 partitioned parameter: its values are the shards
                module[name] = values["param"].reshape(view.shapes[name]).to(dtype)
            if name in frozen:
                continue
            fp32[name] = values.pop("param")
            moments[name] = values
    finally:
        view.close()
    members = _membership(names, len(scalars["param_groups"]), patterns)
    groups = []
    for names_of, saved in zip(members, scalars["param_groups"]):
        step = saved.get("state", {}).get("step")
        step = None if step is None else torch.as_tensor(step, dtype=torch.float32).clone()
        groups.append(GroupState(names_of, dict(saved["hyper"]), step))
    scaler, cur_iter = _scaler(scalars.get("loss_scaler"), config)
    dtypes = {manifest["tensors"][n]["dtype"] for n in names}
    low = next((_DTYPES[d] for d in dtypes if d in _DTYPES), None)
    clip = None if config is None else config.gradient_clipping
    state = WriteState(
        fp32=fp32,
        moments=moments,
        shapes=OrderedDict((n, torch.Size(view.shapes[n])) for n in names),
        groups=groups,
        scaler=scaler,
        cur_iter=int(cur_iter if cur_iter is not None else engine.get("global_steps", 0)),
        clip=None if clip is None else float(clip),
        module=module,
    )
    return state, engine, low, manifest


def convert_to_deepspeed(
    ds_checkpoint_dir: str | Path,
    out_dir: str | Path,
    *,
    tag: str | None = None,
    world_size: int | None = None,
    stage: int | None = None,
    param_groups: Sequence[str] | None = None,
    config: Mapping[str, Any] | None = None,
) -> Path:
    """Write the ds checkpoint ``ds_checkpoint_dir`` (``tag``: default ``latest``) in
    DeepSpeed's layout under ``out_dir``; returns the tag folder written.

    Example:
        >>> convert_to_deepspeed("ckpts", "ckpts_deepspeed", world_size=8)
    """
    folder = _tag_folder(Path(ds_checkpoint_dir), tag)
    if not folder.is_dir():
        raise DeepSpeedCheckpointError(f"{str(folder)!r} is not a checkpoint folder")
    if is_pipeline(folder) or is_moe(folder):
        return _convert_layout(folder, Path(out_dir), world_size, stage, config)
    _refuse_unsupported(folder)
    engine = torch.load(
        folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True
    )
    world = int(world_size or engine.get("dp_world_size") or 1)
    parsed = None if config is None else DeepSpeedConfig.from_dict(config, dp_world_size=world)
    state, engine, low, manifest = _read(folder, param_groups, parsed)
    target = int(stage if stage is not None else manifest.get("stage") or 0)
    if target not in (0, 1, 2, 3) or world < 1:
        raise DeepSpeedCheckpointError(
            f"stage={target}, world_size={world}: DeepSpeed's stages are 0-3, world size >= 1"
        )
    meta = {
        "buffer_names": engine.get("buffer_names", []),
        "lr_scheduler": engine.get("lr_scheduler"),
        "skipped_steps": engine.get("skipped_steps", 0),
        "global_steps": engine.get("global_steps", 0),
        "global_samples": engine.get("global_samples", 0),
        "ds_config": dict(config or {}),
    }
    scheduler = meta["lr_scheduler"]
    if isinstance(scheduler, dict) and "last_batch_iteration" in scheduler:
        meta["lr_scheduler"] = {"last_batch_iteration": scheduler["last_batch_iteration"]}
    root = Path(out_dir) / folder.name
    client = dict(engine.get("client_state") or {})
    write_layout(root, state, meta, world=world, stage=target, dtype=low, client=client)
    (Path(out_dir) / "latest").write_text(folder.name)
    return root


def _convert_layout(
    folder: Path,
    out_dir: Path,
    world_size: int | None,
    stage: int | None,
    config: Mapping[str, Any] | None,
) -> Path:
    """A ds pipeline or MoE checkpoint (see ``_convert_layouts``)."""
    pipeline = is_pipeline(folder)
    saved_world = world_size
    if saved_world is None and pipeline:
        saved_world = len(list(folder.glob("pp_rank_00_dp_rank_*_states.pt")))
    elif saved_world is None:
        engine = torch.load(
            folder / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True
        )
        saved_world = int(engine.get("dp_world_size") or 1)
    parsed = (
        None if config is None else DeepSpeedConfig.from_dict(config, dp_world_size=saved_world)
    )
    clip = None if parsed is None else float(parsed.gradient_clipping)
    root = out_dir / folder.name
    convert = convert_pipeline if pipeline else convert_moe
    convert(
        folder,
        root,
        world=world_size,
        stage=stage,
        config=config,
        clip=clip,
        scaler=lambda saved: _scaler(saved, parsed),
    )
    (out_dir / "latest").write_text(folder.name)
    return root


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """``ds-to-deepspeed``: convert; prints the folder written."""
    if not isinstance(args, argparse.Namespace):
        args = parse_arguments(args)
    config = json.loads(Path(args.config).read_text()) if args.config else None
    root = convert_to_deepspeed(
        args.ds_checkpoint_dir,
        args.out_dir,
        tag=args.tag,
        world_size=args.world_size,
        stage=args.stage,
        param_groups=args.param_group,
        config=config,
    )
    print(root)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
