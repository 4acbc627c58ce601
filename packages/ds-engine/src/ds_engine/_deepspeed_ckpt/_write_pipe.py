"""A ds pipeline engine's state in the layout DeepSpeed's ``PipelineEngine`` writes.

[Note: DeepSpeed's pipeline checkpoint]
DeepSpeed's ``PipelineModule.save_state_dict`` writes each of a stage's layers that has a
``state_dict`` (parameter-less modules too, as an empty dict) to ``layer_LL-model_states.pt``,
``LL`` the layer's global index; data-parallel rank 0 of each stage writes. The model file is
``mp_rank_SS_model_states.pt`` with ``SS`` the stage (DeepSpeed's model-parallel rank of a
pipeline grid without tensor parallelism), ``module = None`` and ``mp_world_size`` the number of
stages; the ZeRO files are ``zero_pp_rank_R_mp_rank_SS_optim_states.pt``, cut over the stage's
data-parallel group as usual. DeepSpeed runs pipelines at ZeRO stage 0 or 1 only. At stage 0 in
fp32 the optimizer state rides in the model file; a bf16 pipeline at stage 0 is DeepSpeed's
``BF16_Optimizer``, whose stage-0 state DeepSpeed 0.19 writes but cannot load back (it hands its
loader the model file's dict where a list of rank files is expected), so it is refused here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from ds_engine._deepspeed_ckpt._pickle import DeepSpeedCheckpointError, save_file
from ds_engine._deepspeed_ckpt._write_stage0 import stage0_optimizer
from ds_engine._deepspeed_ckpt._write_state import gather_state

__all__ = ["check_pipeline_target", "is_pipeline", "write_pipeline"]


def is_pipeline(engine: Any) -> bool:
    """Whether ``engine`` is ds's pipeline engine (its module a ``PipelineModule``)."""
    return hasattr(engine, "pipe") and hasattr(engine.module, "forward_funcs")


def _layers(module: Any, root: Path) -> list[tuple[Path, dict]]:
    """``(file, state dict)`` of each of this stage's layers with a state dict."""
    out = []
    seen: set[int] = set()
    for local, func in enumerate(module.forward_funcs):
        layer = func if isinstance(func, nn.Module) else getattr(func, "module", None)
        if not isinstance(layer, nn.Module) or id(layer) in seen:
            continue
        seen.add(id(layer))
        state = {k: v.detach().cpu().clone() for k, v in layer.state_dict().items()}
        out.append((Path(module.ckpt_layer_path(root, local)), state))
    return out


def check_pipeline_target(stage: int, dtype: str | None) -> None:
    """Refuse what DeepSpeed's pipeline engine cannot resume (see [Note: DeepSpeed's pipeline
    checkpoint])."""
    if stage > 1:
        raise DeepSpeedCheckpointError(
            f"stage={stage}: DeepSpeed's pipeline engine runs at ZeRO stage 0 or 1 only; "
            "write the pipeline checkpoint with stage=1"
        )
    if stage == 0 and dtype == "bf16":
        raise DeepSpeedCheckpointError(
            "a bf16 pipeline at ZeRO stage 0 is DeepSpeed's BF16_Optimizer, whose checkpoint "
            "DeepSpeed 0.19 cannot load back; write it with stage=1 (and train DeepSpeed at "
            "zero_optimization.stage 1)"
        )


def write_pipeline(
    engine: Any, root: Path, *, world: int, stage: int, client: dict[str, Any]
) -> None:
    """Write this pipeline stage's files (see [Note: DeepSpeed's pipeline checkpoint]);
    collective over the stage's data-parallel group."""
    from ds_engine._deepspeed_ckpt._write import (
        engine_meta,
        low_precision,
        model_states,
        write_optimizer_files,
    )

    dtype = low_precision(engine)
    check_pipeline_target(stage, dtype)
    module = engine.module
    state = gather_state(engine, module)
    if state is None:
        return
    root.mkdir(parents=True, exist_ok=True)
    stages = int(getattr(module, "num_stages", 1))
    stage_id = int(getattr(engine, "stage_id", 0))
    for path, layer_state in _layers(module, root):
        save_file(layer_state, path)
    optimizer = stage0_optimizer(state, dtype is not None) if stage == 0 else None
    states = model_states(
        engine_meta(engine),
        state,
        module=None,
        optimizer=optimizer,
        world=world,
        stage=stage,
        mp_world=stages,
        pp_degree=stages,
        client_state=client,
    )
    write_optimizer_files(
        root, state, world=world, stage=stage, bf16=dtype == "bf16", mp_rank=stage_id
    )
    save_file(states, root / f"mp_rank_{stage_id:02d}_model_states.pt")
