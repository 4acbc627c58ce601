"""``deepspeed.checkpoint``: checkpoint helpers (``checkpoint.utils``).

DeepSpeed's universal-checkpoint tools (``DeepSpeedCheckpoint``, ``ds_to_universal``) are not
implemented in ds: those names import and refuse use. ds's checkpoints load across data-parallel
sizes directly (ds-zero's sharded checkpoints), and ``deepspeed.utils.zero_to_fp32`` consolidates
them.
"""

from __future__ import annotations

from ds_engine._not_implemented import not_implemented
from ds_engine.checkpoint import utils

DeepSpeedCheckpoint = not_implemented(
    "deepspeed.checkpoint.DeepSpeedCheckpoint", "universal checkpoint reshaping"
)

__all__ = ["DeepSpeedCheckpoint", "utils"]
