"""A DeepSpeed checkpoint, loaded into a ds engine of any world size and ZeRO stage.

The checkpoint is read whole (see [Note: DeepSpeed's checkpoint layout]); the module gets its
weights, and the ZeRO optimizer its fp32 masters and moments through
``load_checkpoint_shards`` (a lookup of any element range by parameter name, the same entry
ds's own reshardable checkpoints use; MoE experts by global id), then the scalars: ``step`` and each param group's
hyper-parameters, the loss scaler, the LR schedule and the engine's counters.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ds_engine._deepspeed_ckpt._pickle import DeepSpeedCheckpointError
from ds_engine._deepspeed_ckpt._read import DeepSpeedState, read_checkpoint
from ds_engine._deepspeed_ckpt._read_moe import EXPERT_PARAM
from ds_engine._moe import load_module_state
from ds_zero import CheckpointError, GatheredParameters, Stage3Optimizer, ZeroOptimizer

if TYPE_CHECKING:
    from pathlib import Path

    from ds_engine._engine import DeepSpeedEngine

__all__ = ["load_deepspeed_checkpoint", "load_deepspeed_pipeline_checkpoint"]


def trainable_names(module: torch.nn.Module) -> list[str]:
    """Trainable parameter names in module order (tied parameters once)."""
    return [n for n, p in module.named_parameters() if p.requires_grad]


def _load_module(engine: DeepSpeedEngine, state: DeepSpeedState, strict: bool) -> None:
    if state.experts:
        if engine.expert_groups is None:
            raise DeepSpeedCheckpointError(
                f"{str(state.path)!r} holds MoE expert files {state.experts[:2]} but the model "
                "has no MoE layers"
            )
        load_module_state(
            engine.module, state.path, dict(state.module), engine.expert_groups, strict
        )
        return
    targets = dict(engine.module.state_dict(keep_vars=True))
    saved = state.module
    missing = [k for k in targets if k not in saved]
    unexpected = [k for k in saved if k not in targets]
    if strict and (missing or unexpected):
        raise DeepSpeedCheckpointError(
            f"DeepSpeed checkpoint {str(state.model_file)!r} does not fit the model: missing "
            f"keys {missing[:8]}, unexpected keys {unexpected[:8]}"
        )
    with torch.no_grad():
        for name, target in targets.items():
            if name not in saved:
                continue
            value = saved[name]
            with GatheredParameters([target], modifier_rank=0):
                if tuple(value.shape) != tuple(target.shape):
                    raise DeepSpeedCheckpointError(
                        f"{str(state.model_file)!r}: {name!r} has shape {tuple(value.shape)}, "
                        f"the model's is {tuple(target.shape)}"
                    )
                target.data.copy_(value)


class _Lookup:
    """ds-zero's shard lookup over a read checkpoint. This rank's local expert names are
    asked for under their global ids (``per_rank_names``: ranks holding different experts
    under the same local names may load, see [Note: DeepSpeed's MoE optimizer files])."""

    per_rank_names = True

    def __init__(self, state: DeepSpeedState, module: torch.nn.Module) -> None:
        self.state = state
        self.global_names = global_expert_names(module) if state.experts else {}

    def __call__(self, name: str, start: int, stop: int) -> Mapping[str, torch.Tensor]:
        state = self.state
        key = self.global_names.get(name, name)
        if key not in state.fp32:
            raise CheckpointError(
                f"parameter {key!r} is not in the DeepSpeed checkpoint {str(state.path)!r}"
            )
        values = {"param": state.fp32[key][start:stop]}
        for moment, value in state.moments.get(key, {}).items():
            values[moment] = value[start:stop]
        return values


def global_expert_names(module: torch.nn.Module) -> dict[str, str]:
    """This rank's expert parameter names (local ids) -> the same names with global ids:
    local id ``i`` of an MoE layer at expert-parallel rank ``e`` with ``L`` local experts is
    global ``e * L + i`` (DeepSpeed's numbering)."""
    ds_moe = sys.modules.get("ds_moe")
    if ds_moe is None:
        return {}
    names: dict[str, str] = {}
    for layer_name, found in module.named_modules():
        if not isinstance(found, ds_moe.MoE):
            continue
        layer: Any = found
        group = layer.expert_group
        local = int(layer.num_local_experts)
        first = (int(group.expert_parallel_rank) if group is not None else 0) * local
        prefix = f"{layer_name}." if layer_name else ""
        for name, _ in layer.named_parameters():
            match = EXPERT_PARAM.match(prefix + name)
            if match is not None:
                names[prefix + name] = (
                    f"{match['prefix']}{first + int(match['id'])}.{match['suffix']}"
                )
    return names


def _restore_scalars(optimizer: Any, state: DeepSpeedState) -> None:
    groups = optimizer.param_groups
    if len(groups) != len(state.groups):
        raise DeepSpeedCheckpointError(
            f"the DeepSpeed checkpoint {str(state.path)!r} has {len(state.groups)} parameter "
            f"groups, the optimizer has {len(groups)}; build it with the same param groups"
        )
    inner = getattr(optimizer, "optimizer", None)
    for group, saved in zip(groups, state.groups):
        for key, value in saved["hyper"].items():
            if key in group and key != "params":
                group[key] = value
        step = saved["step"]
        if step is None or inner is None:
            continue
        for p in group["params"]:
            slot = inner.state.setdefault(p, {})
            old = slot.get("step")
            if torch.is_tensor(old):
                slot["step"] = torch.as_tensor(step, dtype=old.dtype).to(old.device).clone()
            else:
                slot["step"] = torch.as_tensor(step).clone() if old is None else type(old)(step)


def _restore_loss_scaler(target: Any, state: DeepSpeedState) -> None:
    if target is None or not state.loss_scaler:
        return
    current = target.state_dict()
    saved = state.loss_scaler
    target.load_state_dict({k: saved.get(k, v) for k, v in current.items()})


def load_deepspeed_checkpoint(
    engine: DeepSpeedEngine,
    path: Path,
    *,
    strict: bool,
    optimizer_states: bool,
    lr_scheduler_states: bool,
    module_only: bool,
    custom_load_fn: Callable[..., Any] | None = None,
) -> tuple[str, dict[str, Any]]:
    """Load the DeepSpeed tag directory ``path`` into ``engine`` (every rank calls it; each
    reads the whole checkpoint). Returns ``(path, client_state)`` like
    :meth:`DeepSpeedEngine.load_checkpoint`."""
    state = read_checkpoint(path, trainable_names(engine.module))
    if custom_load_fn is not None:
        custom_load_fn(src=state.module, dst=engine.module)
    else:
        _load_module(engine, state, strict)
    optimizer = engine.optimizer
    zero = isinstance(optimizer, (ZeroOptimizer, Stage3Optimizer))
    if optimizer_states and zero and not module_only:
        if not state.fp32:
            raise DeepSpeedCheckpointError(
                f"the DeepSpeed checkpoint {str(state.path)!r} holds no optimizer state; load "
                "it with load_optimizer_states=False"
            )
        optimizer.load_checkpoint_shards(_Lookup(state, engine.module))
        _restore_scalars(optimizer, state)
        _restore_loss_scaler(engine.loss_scaler, state)
    elif zero:
        optimizer.refresh_fp32_params()
    elif optimizer_states and optimizer is not None and not module_only:
        raise DeepSpeedCheckpointError(
            f"loading a DeepSpeed checkpoint's optimizer state into a "
            f"{type(optimizer).__name__} is not implemented; pass load_optimizer_states=False"
        )
    client = dict(state.client_state)
    if module_only:
        return str(path), client
    engine_state = state.engine
    if lr_scheduler_states and engine.lr_scheduler is not None and engine_state.get("lr_scheduler"):
        engine.lr_scheduler.load_state_dict(engine_state["lr_scheduler"])
    steps = int(engine_state.get("global_steps", 0))
    engine.global_steps = steps
    engine.global_samples = int(
        engine_state.get("global_samples", steps * engine.train_batch_size())
    )
    engine.skipped_steps = int(engine_state.get("skipped_steps", 0))
    engine.micro_steps = steps * engine.gradient_accumulation_steps()
    for key in ("global_steps", "skipped_steps"):
        if zero and hasattr(optimizer, key):
            setattr(optimizer, key, int(getattr(engine, key)))
    if zero and hasattr(optimizer, "micro_steps"):
        optimizer.micro_steps = engine.micro_steps
    return str(path), client


def load_deepspeed_pipeline_checkpoint(
    engine: Any,
    path: Path,
    *,
    strict: bool,
    optimizer_states: bool,
    lr_scheduler_states: bool,
    module_only: bool,
) -> tuple[str, dict[str, Any]]:
    """Load a DeepSpeed ``PipelineModule`` checkpoint (``layer_XX-model_states.pt`` plus the
    ZeRO files) into ds's pipeline engine: this stage's layers, its share of the optimizer
    state, the schedule and the step counters."""
    state = read_checkpoint(path, trainable_names(engine.module))
    own = engine.module.state_dict()
    missing = [k for k in own if k not in state.module]
    if strict and missing:
        raise DeepSpeedCheckpointError(
            f"DeepSpeed pipeline checkpoint {str(path)!r} has no weights for {missing[:8]}"
        )
    with torch.no_grad():
        for key, target in own.items():
            if key in state.module:
                target.copy_(state.module[key])
    zero = getattr(engine, "zero", None)
    if optimizer_states and zero is not None and not module_only:
        zero.load_checkpoint_shards(_Lookup(state, engine.module))
        _restore_scalars(zero, state)
        _restore_loss_scaler(engine.loss_scaler, state)
    elif zero is not None and hasattr(zero, "refresh_fp32_params"):
        zero.refresh_fp32_params()
    elif optimizer_states and not module_only and state.fp32:
        raise DeepSpeedCheckpointError(
            f"loading the optimizer state of {str(path)!r} into a pipeline without a ZeRO "
            "optimizer (stage 0 in fp32) is not implemented; pass load_optimizer_states=False "
            "or train at zero_optimization.stage 1"
        )
    client = dict(state.client_state)
    if module_only:
        return str(path), client
    saved = state.engine
    if lr_scheduler_states and engine.lr_scheduler is not None and saved.get("lr_scheduler"):
        engine.lr_scheduler.load_state_dict(saved["lr_scheduler"])
    engine.pipe.global_steps = int(saved.get("global_steps", 0))
    engine.pipe.skipped_steps = int(saved.get("skipped_steps", 0))
    return str(path), client
