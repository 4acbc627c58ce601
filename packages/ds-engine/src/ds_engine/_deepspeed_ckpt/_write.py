"""A ds engine's state, written in DeepSpeed's checkpoint layout so real DeepSpeed resumes it.

Every rank hands its :class:`~ds_zero.TensorShard` pieces to the others of its data-parallel
group; data-parallel rank 0 assembles each parameter whole (see [Note: writing DeepSpeed's
layout]) and writes the files DeepSpeed 0.19 writes for the requested data-parallel world size
and ZeRO stage, pickled with DeepSpeed's own global names (see [Note: DeepSpeed's pickled
types]). DeepSpeed cannot change the data-parallel world size of a ZeRO checkpoint when it loads
one, so the writer lays the partitions out for the world size DeepSpeed will run on.

The files, by case (DeepSpeed's names):

- every case: ``mp_rank_XX_model_states.pt`` (module weights, scheduler, step counters, client
  state; ``XX`` is the pipeline stage), and ``latest`` naming the tag;
- ZeRO stage 0: the optimizer state inside the model file (see [Note: DeepSpeed's stage-0
  optimizer state]);
- stages 1-2: ``[bf16_]zero_pp_rank_R_mp_rank_XX_optim_states.pt`` per rank; stage 3 also
  ``zero_pp_rank_R_mp_rank_XX_model_states.pt`` per rank (see [Note: DeepSpeed's ZeRO
  partitions]);
- a ``PipelineModule``: ``layer_LL-model_states.pt`` per layer, ``module = None`` in the model file
  (``_write_pipe``);
- MoE layers: ``layer_L_expert_E_mp_rank_XX_model_states.pt`` per expert and, at stage 0,
  ``expp_rank_R_mp_rank_XX_optim_states.pt`` per expert-parallel rank (``_write_moe``).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ds_engine._deepspeed_ckpt._pickle import DeepSpeedCheckpointError, save_file
from ds_engine._deepspeed_ckpt._write_stage0 import stage0_optimizer
from ds_engine._deepspeed_ckpt._write_state import WriteState, gather_state, zero_optimizer_of
from ds_engine._deepspeed_ckpt._write_zero import stage3_files, stage12_files

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = [
    "DEEPSPEED_VERSION",
    "engine_meta",
    "model_states",
    "save_deepspeed_checkpoint",
    "write_layout",
]

DEEPSPEED_VERSION = "0.19.8"  # the layout written (DeepSpeed 0.16-0.19 read it)


def _scheduler_state(engine: Any) -> Any:
    scheduler = getattr(engine, "lr_scheduler", None)
    if scheduler is None:
        return None
    saved = scheduler.state_dict()
    if "last_batch_iteration" in saved:  # DeepSpeed's own schedulers keep only this
        return {"last_batch_iteration": saved["last_batch_iteration"]}
    return saved


def engine_meta(engine: Any) -> dict[str, Any]:
    """The model file's run-level entries of ``engine`` (see :func:`model_states`)."""
    config = getattr(engine, "config", None)
    return {
        "buffer_names": [n for n, _ in engine.module.named_buffers()],
        "lr_scheduler": _scheduler_state(engine),
        "skipped_steps": int(engine.skipped_steps),
        "global_steps": int(engine.global_steps),
        "global_samples": int(engine.global_samples),
        "ds_config": dict(config) if isinstance(config, dict) else {},
    }


def model_states(
    meta: Mapping[str, Any],
    state: WriteState,
    *,
    module: Any,
    optimizer: Any,
    world: int,
    stage: int,
    mp_world: int = 1,
    pp_degree: int = 1,
    client_state: Mapping[str, Any],
) -> dict[str, Any]:
    """``mp_rank_XX_model_states.pt``'s dict as DeepSpeed's ``_common_checkpoint_state``;
    ``meta`` holds the run-level entries (:func:`engine_meta`)."""
    zero = stage > 0
    shapes = [OrderedDict((n, state.shapes[n]) for n in g.names) for g in state.groups]
    return {
        "module": module,
        "buffer_names": list(meta.get("buffer_names", [])),
        "optimizer": optimizer,
        "param_shapes": shapes if zero else None,
        "frozen_param_shapes": OrderedDict() if stage >= 2 else None,
        "shared_params": {} if zero else None,
        "frozen_param_fragments": OrderedDict() if stage >= 2 else None,
        "lr_scheduler": meta.get("lr_scheduler"),
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": int(meta.get("skipped_steps", 0)),
        "global_steps": int(meta.get("global_steps", 0)),
        "global_samples": int(meta.get("global_samples", 0)),
        "dp_world_size": world,
        "mp_world_size": mp_world,
        "checkpoint_parallel_dimensions": {"pp_degree": pp_degree, "tp_degree": 1},
        "ds_config": dict(meta.get("ds_config") or {}),
        "ds_version": DEEPSPEED_VERSION,
        **dict(client_state),
    }


def low_precision(engine: Any) -> str | None:
    """``"bf16"``, ``"fp16"`` or None: the model dtype DeepSpeed's files are written for."""
    config = engine._config
    if config.bf16.enabled:
        return "bf16"
    return "fp16" if config.fp16.enabled else None


def write_optimizer_files(
    root: Path, state: WriteState, *, world: int, stage: int, bf16: bool, mp_rank: int = 0
) -> None:
    """The ZeRO optimizer files of stages 1-3 (nothing at stage 0)."""
    if stage == 0:
        return
    files = (
        stage3_files(state, world)
        if stage == 3
        else stage12_files(state, world, stage, DEEPSPEED_VERSION)
    )
    prefix = "bf16_" if bf16 else ""
    for r, optim in enumerate(files):
        wrapped = {"optimizer_state_dict": optim, "ds_config": {}, "ds_version": DEEPSPEED_VERSION}
        save_file(wrapped, root / f"{prefix}zero_pp_rank_{r}_mp_rank_{mp_rank:02d}_optim_states.pt")


def write_layout(
    root: Path,
    state: WriteState,
    meta: Mapping[str, Any],
    *,
    world: int,
    stage: int,
    dtype: str | None,
    client: Mapping[str, Any],
) -> None:
    """Write a plain (not pipeline, not MoE) model's files into the tag folder ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    optimizer = stage0_optimizer(state, dtype is not None) if stage == 0 else None
    module: Any = state.module
    if stage == 3:
        trainable = set(state.shapes)
        module = OrderedDict(
            (k, v.new_empty(0)) if k in trainable else (k, v) for k, v in state.module.items()
        )
    states = model_states(
        meta,
        state,
        module=module,
        optimizer=optimizer,
        world=world,
        stage=stage,
        client_state=client,
    )
    write_optimizer_files(root, state, world=world, stage=stage, bf16=dtype == "bf16")
    if stage == 3:
        for r in range(world):
            save_file(states, root / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
    else:
        save_file(states, root / "mp_rank_00_model_states.pt")


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save_deepspeed_checkpoint(
    engine: Any,
    save_dir: str | os.PathLike[str],
    tag: str | None = None,
    *,
    client_state: Mapping[str, Any] | None = None,
    world_size: int | None = None,
    stage: int | None = None,
) -> Path:
    """Write ``engine``'s state as DeepSpeed 0.19 would have saved it, for real DeepSpeed's
    ``load_checkpoint`` to resume. Every rank must call it; data-parallel rank 0 writes.

    Args:
        engine: a ds engine (or pipeline engine) with ds's ZeRO optimizer, any stage, any number
            of param groups; MoE layers and ``PipelineModule`` models included.
        save_dir: the DeepSpeed ``save_dir`` (``<save_dir>/<tag>/`` and ``latest``).
        tag: default ``global_step<N>`` as DeepSpeed.
        client_state: extra top-level keys of the model file (DeepSpeed returns them).
        world_size: DeepSpeed's data-parallel world size (default: this run's).
        stage: DeepSpeed's ZeRO stage, 0-3 (default: this run's).

    Raises:
        DeepSpeedCheckpointError: a stage, optimizer or model DeepSpeed's layout is not written
            for (named in the message).
    """
    from ds_engine._deepspeed_ckpt._write_moe import has_moe, write_moe
    from ds_engine._deepspeed_ckpt._write_pipe import is_pipeline, write_pipeline

    zero_optimizer_of(engine)  # refuses a non-ZeRO optimizer before any collective
    world = int(world_size or engine.dp_world_size)
    stage = int(stage if stage is not None else engine._config.zero_optimization.stage)
    if stage not in (0, 1, 2, 3):
        raise DeepSpeedCheckpointError(f"stage={stage}: DeepSpeed's ZeRO stages are 0, 1, 2, 3")
    if world < 1:
        raise DeepSpeedCheckpointError(f"world_size={world}: pass a positive world size")
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    root = Path(save_dir) / tag
    client = dict(client_state or {})
    if is_pipeline(engine):
        write_pipeline(engine, root, world=world, stage=stage, client=client)
    elif has_moe(engine.module):
        write_moe(engine, root, world=world, stage=stage, client=client)
    else:
        state = gather_state(engine, engine.module)
        if state is not None:
            meta = engine_meta(engine)
            dtype = low_precision(engine)
            write_layout(root, state, meta, world=world, stage=stage, dtype=dtype, client=client)
    if int(engine.global_rank) == 0:
        (Path(save_dir) / "latest").write_text(tag)
    _barrier()
    return root
