"""``deepspeed.runtime.zero.stage3``: the stage 3 optimizer and its memory estimators (ds-zero).

``DeepSpeedZeroOptimizer_Stage3`` is ``ds_zero.Stage3Optimizer`` (for ``isinstance``; its
constructor is ds-zero's, which ``initialize()`` calls for you).
"""

from __future__ import annotations

from ds_zero import (
    Stage3Optimizer,
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)

DeepSpeedZeroOptimizer_Stage3 = Stage3Optimizer

__all__ = [
    "DeepSpeedZeroOptimizer_Stage3",
    "Stage3Optimizer",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
]
