"""A ds engine's state, written in DeepSpeed's checkpoint layout so real DeepSpeed resumes it.

Every rank hands its :class:`~ds_zero.TensorShard` pieces (fp32 masters and Adam moments) to
every other; global rank 0 assembles each parameter whole and writes the files DeepSpeed 0.19
writes for the requested data-parallel world size and ZeRO stage (see [Note: DeepSpeed's
checkpoint layout]), pickled with DeepSpeed's own global names (see [Note: DeepSpeed's pickled
types]). DeepSpeed cannot change the data-parallel world size of a ZeRO checkpoint when it
loads one, so the writer lays the partitions out for the world size DeepSpeed will run on.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from ds_engine._deepspeed_ckpt._pickle import (
    DeepSpeedCheckpointError,
    DynamicLossScalerState,
    FragmentAddress,
    LossScalerState,
    ZeroStage,
    save_file,
)
from ds_zero import GatheredParameters, Stage3Optimizer, ZeroOptimizer

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ds_engine._engine import DeepSpeedEngine

__all__ = ["save_deepspeed_checkpoint"]

DEEPSPEED_VERSION = "0.19.8"  # the layout written (DeepSpeed 0.16-0.19 read it)
_ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor (stages 1-2)


def _gather_pieces(engine: DeepSpeedEngine) -> list[tuple[str, tuple, int, int, dict]]:
    optimizer = _zero_optimizer(engine)
    mine = [
        (
            s.name,
            tuple(s.shape),
            s.start,
            s.stop,
            {k: v.detach().float().cpu() for k, v in s.values.items()},
        )
        for s in optimizer.checkpoint_shards()
        if s.stop > s.start
    ]
    if not (dist.is_available() and dist.is_initialized()) or engine.dp_world_size == 1:
        return mine
    out: list[Any] = [None] * engine.dp_world_size
    dist.all_gather_object(out, mine, group=engine.dp_group)
    return [piece for pieces in out for piece in pieces]


def _assemble(pieces: list) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    fp32: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for name, shape, start, stop, values in pieces:
        numel = math.prod(shape)
        for key, value in values.items():
            target = fp32 if key == "param" else moments.setdefault(name, {})
            whole = (
                target.setdefault(name, torch.zeros(numel))
                if key == "param"
                else target.setdefault(key, torch.zeros(numel))
            )
            whole[start:stop].copy_(value.reshape(-1))
    return fp32, moments


def _module_weights(engine: DeepSpeedEngine) -> dict[str, torch.Tensor]:
    """The module's state dict on every rank, ZeRO-3 parameters gathered one at a time."""
    state: dict[str, torch.Tensor] = OrderedDict()
    for key, value in engine.module.state_dict(keep_vars=True).items():
        with GatheredParameters([value]):
            state[key] = value.detach().cpu().clone()
    return state


def _zero_optimizer(engine: DeepSpeedEngine) -> ZeroOptimizer | Stage3Optimizer:
    """The engine's optimizer, typed as the ZeRO one save_deepspeed_checkpoint checked."""
    return cast("ZeroOptimizer | Stage3Optimizer", engine.optimizer)


def _scalars(engine: DeepSpeedEngine) -> tuple[Any, list[dict[str, Any]]]:
    optimizer = _zero_optimizer(engine)
    inner = getattr(optimizer, "optimizer", optimizer)
    step = None
    for value in inner.state.values():
        if "step" in value:
            step = value["step"]
            break
    step = torch.as_tensor(step if step is not None else 0, dtype=torch.float32).clone()
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return step, hyper


def _loss_scaler(engine: DeepSpeedEngine) -> LossScalerState:
    scaler = engine.loss_scaler
    if scaler is None:
        return LossScalerState(cur_scale=1.0, dynamic=False)
    state = scaler.state_dict()
    if "cur_iter" not in state:
        return LossScalerState(cur_scale=float(state["cur_scale"]), dynamic=False)
    defaults = {
        "scale_factor": 2.0,
        "scale_window": 1000,
        "min_scale": 1,
        "delayed_shift": 2,
        "consecutive_hysteresis": False,
        "raise_error_at_min_scale": True,
    }
    extra = {k: getattr(scaler, k, v) for k, v in defaults.items()}
    return DynamicLossScalerState(
        cur_scale=float(state["cur_scale"]),
        dynamic=True,
        cur_iter=int(state["cur_iter"]),
        last_overflow_iter=int(state["last_overflow_iter"]),
        cur_hysteresis=int(state["cur_hysteresis"]),
        dtype=torch.float16,
        **extra,
    )


def _model_states(
    engine: DeepSpeedEngine,
    module: Mapping[str, torch.Tensor],
    shapes: OrderedDict,
    world: int,
    client_state: Mapping[str, Any],
) -> dict[str, Any]:
    scheduler = engine.lr_scheduler
    return {
        "module": module,
        "buffer_names": [n for n, _ in engine.module.named_buffers()],
        "optimizer": None,
        "param_shapes": [shapes],
        "frozen_param_shapes": OrderedDict(),
        "shared_params": {},
        "frozen_param_fragments": OrderedDict(),
        "lr_scheduler": (
            {"last_batch_iteration": scheduler.state_dict()["last_batch_iteration"]}
            if scheduler is not None and "last_batch_iteration" in scheduler.state_dict()
            else (scheduler.state_dict() if scheduler is not None else None)
        ),
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": engine.skipped_steps,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "dp_world_size": world,
        "mp_world_size": 1,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": {},
        "ds_version": DEEPSPEED_VERSION,
        **dict(client_state),
    }


def _stage12_files(fp32, moments, names, world, stage, step, hyper, scaler, clip) -> list[dict]:
    flat = torch.cat([fp32[n] for n in names])
    total = flat.numel()
    padded = math.ceil(total / (_ALIGNMENT * world)) * _ALIGNMENT * world
    part = padded // world
    flats = {"param": torch.nn.functional.pad(flat, (0, padded - total))}
    for key in moments[names[0]]:
        whole = torch.cat([moments[n][key] for n in names])
        flats[key] = torch.nn.functional.pad(whole, (0, padded - total))
    offsets, at = {}, 0
    for n in names:
        offsets[n] = (at, at + fp32[n].numel())
        at += fp32[n].numel()
    files = []
    for r in range(world):
        low, high = r * part, (r + 1) * part
        padding = max(0, high - total) if r == world - 1 else 0
        mapping = OrderedDict()
        for n, (begin, end) in offsets.items():
            lo, hi = max(low, begin), min(high, end)
            if lo < hi:
                mapping[n] = FragmentAddress(numel=hi - lo, start=lo - low)
        state = {k: v[low:high].clone() for k, v in flats.items() if k != "param"}
        files.append(
            {
                "loss_scaler": scaler,
                "dynamic_loss_scale": isinstance(scaler, DynamicLossScalerState),
                "overflow": False,
                "clip_grad": clip,
                "base_optimizer_state": {
                    "state": {0: {"step": step.clone(), **state}},
                    "param_groups": [{**hyper[0], "params": [0]}],
                },
                "single_partition_of_fp32_groups": [flats["param"][low : high - padding].clone()],
                "zero_stage": ZeroStage(stage),
                "group_paddings": [padding],
                "param_alignment_paddings": [[0] * len(names)],
                "partition_count": [world],
                "ds_version": DEEPSPEED_VERSION,
                "param_slice_mappings": [mapping],
            }
        )
    return files


def _stage3_files(fp32, moments, names, world, step, hyper, scaler) -> list[dict]:
    def split(values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        parts: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for n in names:
            size = math.ceil(values[n].numel() / world)
            padded = torch.nn.functional.pad(values[n], (0, size * world - values[n].numel()))
            for r in range(world):
                parts[r].append(padded[r * size : (r + 1) * size])
        return [torch.cat(p) for p in parts]

    masters = split(fp32)
    states = {key: split({n: moments[n][key] for n in names}) for key in moments[names[0]]}
    return [
        {
            "zero_stage": ZeroStage.weights,
            "loss_scaler": scaler,
            "dynamic_loss_scale": isinstance(scaler, DynamicLossScalerState),
            "overflow": False,
            "partition_count": world,
            "optimizer_state_dict": {
                "state": {0: {"step": step.clone(), **{k: v[r] for k, v in states.items()}}},
                "param_groups": [{**hyper[0], "params": [0]}],
            },
            "fp32_flat_groups": [masters[r]],
        }
        for r in range(world)
    ]


def save_deepspeed_checkpoint(
    engine: DeepSpeedEngine,
    save_dir: str | os.PathLike[str],
    tag: str | None = None,
    *,
    client_state: Mapping[str, Any] | None = None,
    world_size: int | None = None,
    stage: int | None = None,
) -> Path:
    """Write ``engine``'s state as DeepSpeed 0.19 would have saved it, for real DeepSpeed's
    ``load_checkpoint`` to resume. Every rank must call it; global rank 0 writes.

    Args:
        engine: a ds engine with a ZeRO optimizer (any stage) and one param group.
        save_dir: the DeepSpeed ``save_dir`` (``<save_dir>/<tag>/`` and ``latest``).
        tag: default ``global_step<N>`` as DeepSpeed.
        client_state: extra top-level keys of the model file (DeepSpeed returns them).
        world_size: DeepSpeed's data-parallel world size (default: this run's).
        stage: DeepSpeed's ZeRO stage, 1-3 (default: this run's).

    Raises:
        DeepSpeedCheckpointError: a stage, optimizer or param-group layout not written yet.
    """
    optimizer = engine.optimizer
    if not isinstance(optimizer, (ZeroOptimizer, Stage3Optimizer)):
        raise DeepSpeedCheckpointError(
            f"writing DeepSpeed's layout needs ds's ZeRO optimizer, not {type(optimizer).__name__}"
        )
    world = int(world_size or engine.dp_world_size)
    stage = int(stage if stage is not None else engine._config.zero_optimization.stage)
    if stage not in (1, 2, 3):
        raise DeepSpeedCheckpointError(
            f"writing DeepSpeed's layout for ZeRO stage {stage} is not implemented (stages 1-3 "
            "are); pass stage=1 (DeepSpeed loads ZeRO-1 into stage 1 or 2 only)"
        )
    if len(optimizer.param_groups) != 1:
        raise DeepSpeedCheckpointError(
            f"writing DeepSpeed's layout for {len(optimizer.param_groups)} param groups is not "
            "implemented (one group is)"
        )
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    pieces = _gather_pieces(engine)
    module = _module_weights(engine)
    step, hyper = _scalars(engine)
    if engine.global_rank == 0:
        fp32, moments = _assemble(pieces)
        names = [n for n, p in engine.module.named_parameters() if p.requires_grad and n in fp32]
        shapes = OrderedDict((n, module[n].shape) for n in names)
        root = Path(save_dir) / tag
        root.mkdir(parents=True, exist_ok=True)
        scaler = _loss_scaler(engine)
        bf16 = "bf16_" if engine._config.bf16.enabled else ""
        files = (
            _stage3_files(fp32, moments, names, world, step, hyper, scaler)
            if stage == 3
            else _stage12_files(
                fp32,
                moments,
                names,
                world,
                stage,
                step,
                hyper,
                scaler,
                float(engine._config.gradient_clipping),
            )
        )
        for r, optim in enumerate(files):
            wrapped = {
                "optimizer_state_dict": optim,
                "ds_config": {},
                "ds_version": DEEPSPEED_VERSION,
            }
            save_file(wrapped, root / f"{bf16}zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        if stage == 3:
            empty = OrderedDict(
                (k, v.new_empty(0)) if k in shapes else (k, v) for k, v in module.items()
            )
            states = _model_states(engine, empty, shapes, world, client_state or {})
            for r in range(world):
                save_file(states, root / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
        else:
            states = _model_states(engine, module, shapes, world, client_state or {})
            save_file(states, root / "mp_rank_00_model_states.pt")
        (Path(save_dir) / "latest").write_text(tag)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    return Path(save_dir) / tag
