"""Loading a universal checkpoint (``checkpoint: {load_universal: true}``) into an engine of any
world size and ZeRO stage (see [Note: universal checkpoint layout] in ``ds_to_universal``).

``engine.load_checkpoint(load_dir, tag)`` with ``load_universal`` reads ``load_dir/<tag>``
(``tag`` None: the folder ``load_dir/latest_universal`` names, as DeepSpeed). Each trainable
parameter's weight is its ``zero/<name>/fp32.pt``; buffers and frozen parameters come from the
model-states file. The ZeRO optimizer takes its fp32 masters and moments through
``load_checkpoint_shards`` (a lookup of any element range by name: each rank reads just its
own slice of each file), then the step (``step.pt``), each param group's hyper-parameters
(``zero/optimizer_state.pt``), the LR schedule and the engine's counters (model states).
Folders written by ``ds-to-universal`` and by DeepSpeed's ``ds_to_universal.py`` load alike:
a state file holds ``{"param": tensor, ...}`` (stages 0-2) or the flat tensor (DeepSpeed's
stage 3 output). Every file is read with ``torch.load(weights_only=True)`` and an allow-list
of DeepSpeed's own data types (``ds_engine._deepspeed_ckpt.load_file``): no file runs code.

[Note: MoE universal]
A universal folder of an MoE model holds each expert parameter under its global expert id
(``zero/<...>.deepspeed_experts.<global>.<rest>/fp32.pt``; ``ds-to-universal`` renames the
saving ranks' local ids) and the per-expert weight files beside the model-states file. A loading
rank asks for its experts by their global names (``ds_moe.global_expert_names``), so the folder
loads at any ``ep_size`` and world size. This is ds's extension: DeepSpeed 0.19.8's
``ds_to_universal`` cannot convert a native MoE checkpoint whose ``ep_size`` is above 1 (it
merges different ranks' experts that share a local name, and fails), and its universal loader
looks experts up by local name, so it reads such a folder only at ``ep_size`` 1 (where local and
global names agree); DeepSpeed runs no MoE at ZeRO stage 3.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from ds_engine._deepspeed_ckpt import load_file
from ds_zero import CheckpointError, GatheredParameters, Stage3Optimizer, ZeroOptimizer

if TYPE_CHECKING:
    from ds_engine._engine import DeepSpeedEngine

__all__ = ["load_universal_checkpoint", "universal_folder"]

_LATEST = "latest_universal"
# Model-states keys the engine owns; the others are the client state (DeepSpeed's layout).
_ENGINE_KEYS = frozenset(
    {
        "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
        "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd",
        "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
        "dp_world_size", "mp_world_size", "ds_config", "ds_version", "universal_checkpoint_info",
        "zero_shard_keys", "micro_steps", "data_loader", "client_state",
    }
)  # fmt: skip


def _load(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"universal checkpoint file {str(path)!r} is missing")
    return load_file(path)  # weights only, plus DeepSpeed's four data types


def universal_folder(load_dir: str | os.PathLike[str], tag: str | None) -> Path:
    """``load_dir/tag``; ``tag`` None: the name in ``load_dir/latest_universal``."""
    root = Path(load_dir)
    if tag is None:
        latest = root / _LATEST
        if not latest.is_file():
            raise CheckpointError(
                f"checkpoint.load_universal is set but {str(latest)!r} does not exist: pass the "
                "universal folder's name as tag, or write it with ds-to-universal"
            )
        tag = latest.read_text().strip()
    path = root / str(tag)
    if not (path / "zero").is_dir():
        raise CheckpointError(
            f"{str(path)!r} is not a universal checkpoint (no zero/ folder); convert it with "
            "ds-to-universal, or unset checkpoint.load_universal"
        )
    return path


def _state(folder: Path, name: str, state: str) -> torch.Tensor:
    saved = _load(folder / "zero" / name / f"{state}.pt")
    value = saved["param"] if isinstance(saved, Mapping) else saved
    if not torch.is_tensor(value):
        raise CheckpointError(f"{folder / 'zero' / name / f'{state}.pt'} holds no tensor")
    return value.float().flatten()


def _lookup(
    folder: Path, rename: Mapping[str, str]
) -> Callable[[str, int, int], dict[str, torch.Tensor]]:
    """Any element range of a parameter's saved states, by the loading rank's name (MoE
    experts: ``rename`` maps local to global expert names, see [Note: MoE universal])."""
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def lookup(name: str, start: int, stop: int) -> dict[str, torch.Tensor]:
        name = rename.get(name, name)
        if name not in cache:
            cache.clear()  # one parameter's files in memory at a time
            where = folder / "zero" / name
            files = sorted(p.stem for p in where.glob("*.pt")) if where.is_dir() else []
            if "fp32" not in files:
                raise CheckpointError(f"{str(where / 'fp32.pt')!r} is missing for {name!r}")
            states = [s for s in files if s != "step"]
            cache[name] = {("param" if s == "fp32" else s): _state(folder, name, s) for s in states}
        return {k: v[start:stop] for k, v in cache[name].items()}

    # ds-zero fills param groups on their own process groups (MoE experts) only from a lookup
    # that resolves each rank's own names
    lookup.per_rank_names = bool(rename)  # type: ignore[attr-defined]
    return lookup


def _expert_names(engine: DeepSpeedEngine) -> dict[str, str]:
    """Each of this rank's expert parameters' global name (none without MoE layers)."""
    from ds_engine._moe import checkpoint_names_of

    return checkpoint_names_of(engine.module, getattr(engine, "expert_groups", None)) or {}


def _load_module(
    engine: DeepSpeedEngine,
    folder: Path,
    saved: Mapping[str, Any],
    strict: bool,
    rename: Mapping[str, str],
):
    trainable = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    targets = dict(engine.module.state_dict(keep_vars=True))
    missing = [
        k for k in targets if k not in trainable and k not in saved
    ]  # trainable ones come from zero/<name>/fp32.pt
    if strict and missing:
        raise CheckpointError(f"universal checkpoint {str(folder)!r} lacks {missing[:8]}")
    with torch.no_grad():
        for name, target in targets.items():
            if name in trainable:
                value = _state(folder, rename.get(name, name), "fp32")
            elif name in saved and torch.is_tensor(saved[name]) and saved[name].numel():
                value = saved[name].flatten()
            else:
                continue
            with GatheredParameters([target], modifier_rank=0):
                if value.numel() != target.numel():
                    raise CheckpointError(
                        f"{str(folder)!r}: {name!r} holds {value.numel()} elements, the "
                        f"model's has {target.numel()} ({tuple(target.shape)})"
                    )
                target.data.copy_(value.view(target.shape))


def _step(folder: Path, optim: Mapping[str, Any]) -> Any:
    for step_file in sorted((folder / "zero").glob("*/step.pt")):
        return _load(step_file)
    inner = optim.get("optimizer_state_dict", {}) if isinstance(optim, Mapping) else {}
    for entry in (inner.get("state") or {}).values():  # DeepSpeed's stage 3 output
        if "step" in entry:
            return entry["step"]
    return None


def _as_step(step: Any, old: Any, inner: Any) -> Any:
    """``step`` in the form the optimizer keeps it: a tensor for torch's optimizers (on the
    device and of the dtype of the one they hold, if any), an int for ds's, which count steps
    in Python."""
    value = float(step.item() if torch.is_tensor(step) else step)
    if not type(inner).__module__.startswith("torch."):
        return int(value)
    if torch.is_tensor(old):
        return torch.tensor(value, dtype=old.dtype, device=old.device)
    return torch.tensor(value, dtype=torch.float32)


def _restore_scalars(engine: DeepSpeedEngine, folder: Path, optim: Mapping[str, Any]) -> None:
    # load_universal_checkpoint calls this for ds's ZeRO optimizers only.
    optimizer = cast("ZeroOptimizer | Stage3Optimizer", engine.optimizer)
    saved_groups = optim.get("param_groups") or []
    if saved_groups and len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"{str(folder / 'zero' / 'optimizer_state.pt')!r} has {len(saved_groups)} param "
            f"groups, the optimizer has {len(optimizer.param_groups)}"
        )
    step = _step(folder, optim)
    inner = getattr(optimizer, "optimizer", None)
    for g, group in enumerate(optimizer.param_groups):
        for key, value in (saved_groups[g] if saved_groups else {}).items():
            # a group's identity (MoE: "ep_size_<E>") stays the loading model's
            if key in group and key not in ("params", "name", "moe"):
                group[key] = value
        for p in group["params"] if step is not None and inner is not None else ():
            assert inner is not None  # the loop runs only when it is set
            slot = inner.state.setdefault(p, {})
            slot["step"] = _as_step(step, slot.get("step"), inner)
    scaler = optim.get("loss_scaler")
    scaler = vars(scaler) if hasattr(scaler, "__dict__") else scaler  # DeepSpeed's object
    if engine.loss_scaler is not None and isinstance(scaler, Mapping):
        current = engine.loss_scaler.state_dict()
        engine.loss_scaler.load_state_dict({k: scaler.get(k, v) for k, v in current.items()})


def _model_file(folder: Path) -> Path:
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (folder / name).is_file():
            return folder / name
    raise CheckpointError(f"{str(folder)!r} holds no mp_rank_00_model_states.pt")


def load_universal_checkpoint(
    engine: DeepSpeedEngine,
    load_dir: str | os.PathLike[str],
    *,
    tag: str | None,
    strict: bool,
    optimizer_states: bool,
    lr_scheduler_states: bool,
    module_only: bool,
    custom_load_fn: Callable[..., Any] | None = None,
) -> tuple[str, dict[str, Any]]:
    """Load a universal folder into ``engine`` (every rank calls it); returns ``(path,
    client_state)`` like :meth:`DeepSpeedEngine.load_checkpoint`."""
    folder = universal_folder(load_dir, tag)
    model = _load(_model_file(folder))
    rename = _expert_names(engine)
    if custom_load_fn is not None:
        custom_load_fn(src=model.get("module", {}), dst=engine.module)
    else:
        _load_module(engine, folder, model.get("module", {}), strict, rename)
    optimizer = engine.optimizer
    zero = isinstance(optimizer, (ZeroOptimizer, Stage3Optimizer))
    if optimizer_states and zero and not module_only:
        # ds's ZeRO-3 asks for experts by their global names already
        lookup_names = {} if isinstance(optimizer, Stage3Optimizer) else rename
        optimizer.load_checkpoint_shards(_lookup(folder, lookup_names))
        _restore_scalars(engine, folder, _load(folder / "zero" / "optimizer_state.pt"))
    elif zero:
        optimizer.refresh_fp32_params()
    elif optimizer_states and optimizer is not None and not module_only:
        raise CheckpointError(
            "loading a universal checkpoint's optimizer state needs a ZeRO optimizer (stage 1-3);"
            " pass load_optimizer_states=False"
        )
    client = dict(model.get("client_state") or {})
    client.update({k: v for k, v in model.items() if k not in _ENGINE_KEYS})
    if module_only:
        return str(folder), client
    if lr_scheduler_states and engine.lr_scheduler is not None and model.get("lr_scheduler"):
        engine.lr_scheduler.load_state_dict(model["lr_scheduler"])
    steps = int(model.get("global_steps", 0))
    engine.global_steps = steps
    engine.global_samples = int(model.get("global_samples", steps * engine.train_batch_size()))
    engine.skipped_steps = int(model.get("skipped_steps", 0))
    engine.micro_steps = steps * engine.gradient_accumulation_steps()
    if zero:
        for key in ("global_steps", "skipped_steps", "micro_steps"):
            if hasattr(optimizer, key):
                setattr(optimizer, key, int(getattr(engine, key)))
    return str(folder), client
