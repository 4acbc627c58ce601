"""``deepspeed.checkpoint``: checkpoint helpers (``checkpoint.utils``) and DeepSpeed's universal
checkpoint converter (``checkpoint.ds_to_universal``, also the ``ds-to-universal`` command; a
universal folder loads with ``checkpoint: {load_universal: true}``; see docs/checkpoints.md).

``DeepSpeedCheckpoint`` (DeepSpeed's tensor/pipeline-parallel reshaping reader) is not
implemented in ds: the name imports and refuses use. ds's checkpoints load across data-parallel
sizes directly (ds-zero's sharded checkpoints), and ``deepspeed.utils.zero_to_fp32``
consolidates them.
"""

from __future__ import annotations

from ds_engine._not_implemented import not_implemented
from ds_engine.checkpoint import utils

DeepSpeedCheckpoint = not_implemented(
    "deepspeed.checkpoint.DeepSpeedCheckpoint", "universal checkpoint reshaping"
)

__all__ = ["DeepSpeedCheckpoint", "utils"]
