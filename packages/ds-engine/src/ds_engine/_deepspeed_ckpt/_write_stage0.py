"""DeepSpeed's optimizer state at ZeRO stage 0: the ``optimizer`` entry of the model file.

[Note: DeepSpeed's stage-0 optimizer state]
Without ZeRO, DeepSpeed writes no optimizer files: ``mp_rank_XX_model_states.pt`` carries
``optimizer = engine.optimizer.state_dict()``.

- fp32: the torch optimizer's own ``state_dict()``: one state entry per parameter (ids counted
  across the groups in order), each moment shaped like its parameter, ``step`` a float32 scalar.
- bf16 and fp16 (DeepSpeed wraps a non-fused optimizer such as ``torch_adam`` in
  ``FP16_UnfusedOptimizer``, for bf16 too): ``dynamic_loss_scale``, ``cur_scale``, ``cur_iter``
  (and, when dynamic, ``last_overflow_iter``, ``scale_factor``, ``scale_window``), the torch
  optimizer's ``state_dict()`` as ``optimizer_state_dict``, and the fp32 masters as
  ``fp32_groups`` (a list per group of per-parameter tensors). DeepSpeed's loader copies the
  masters over its own and loads the torch state; the module entry holds the bf16/fp16 weights.

The fused ``FP16_Optimizer`` (DeepSpeed's ``FusedAdam`` on a GPU) keeps one flat master per
group instead; that layout is not written (see ``save_deepspeed_checkpoint``).
"""

from __future__ import annotations

from typing import Any

import torch

from ds_engine._deepspeed_ckpt._pickle import DynamicLossScalerState
from ds_engine._deepspeed_ckpt._write_state import WriteState

__all__ = ["stage0_optimizer", "torch_optimizer_state"]


def torch_optimizer_state(state: WriteState) -> dict[str, Any]:
    """The torch optimizer's ``state_dict()`` DeepSpeed's stage 0 would hold."""
    entries: dict[int, dict[str, torch.Tensor]] = {}
    groups = []
    at = 0
    for g in state.groups:
        ids = []
        for name in g.names:
            shape = state.shapes[name]
            entry = {k: v.reshape(shape).clone() for k, v in state.moments.get(name, {}).items()}
            if entry and g.step is not None:
                entry = {"step": g.step.clone(), **entry}
            if entry:
                entries[at] = entry
            ids.append(at)
            at += 1
        groups.append({**g.hyper, "params": ids})
    return {"state": entries, "param_groups": groups}


def stage0_optimizer(state: WriteState, low_precision: bool) -> dict[str, Any]:
    """The model file's ``optimizer`` entry at stage 0 (see [Note: DeepSpeed's stage-0
    optimizer state])."""
    inner = torch_optimizer_state(state)
    if not low_precision:
        return inner
    scaler = state.scaler
    out: dict[str, Any] = {
        "dynamic_loss_scale": isinstance(scaler, DynamicLossScalerState),
        "cur_scale": float(getattr(scaler, "cur_scale", 1.0)),
        "cur_iter": int(state.cur_iter),
    }
    if isinstance(scaler, DynamicLossScalerState):
        saved = vars(scaler)  # the stand-in's state is its __dict__
        out["last_overflow_iter"] = int(saved["last_overflow_iter"])
        out["scale_factor"] = float(saved["scale_factor"])
        out["scale_window"] = int(saved["scale_window"])
    out["optimizer_state_dict"] = inner
    out["fp32_groups"] = [
        [state.fp32[n].reshape(state.shapes[n]).clone() for n in g.names] for g in state.groups
    ]
    return out
