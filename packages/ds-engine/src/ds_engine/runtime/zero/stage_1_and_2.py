"""``deepspeed.runtime.zero.stage_1_and_2``: the stage 0-2 optimizer and its memory estimators
(ds-zero).

``DeepSpeedZeroOptimizer`` is ``ds_zero.ZeroOptimizer`` (for ``isinstance``; its constructor
is ds-zero's, which ``initialize()`` calls for you).
"""

from __future__ import annotations

from ds_zero import (
    ZeroOptimizer,
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
)

DeepSpeedZeroOptimizer = ZeroOptimizer

__all__ = [
    "DeepSpeedZeroOptimizer",
    "ZeroOptimizer",
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
]
