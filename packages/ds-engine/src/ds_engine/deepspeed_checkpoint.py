"""Checkpoints that cross over to and from DeepSpeed (see ``docs/migration.md``).

``engine.load_checkpoint`` reads a directory DeepSpeed wrote by itself; this module adds the way
back: :func:`save_deepspeed_checkpoint` writes a ds engine's state in DeepSpeed's layout, so real
DeepSpeed's ``load_checkpoint`` resumes the run.
"""

from __future__ import annotations

from ds_engine._deepspeed_ckpt import (
    DEEPSPEED_VERSION,
    DeepSpeedCheckpointError,
    DeepSpeedState,
    is_deepspeed_checkpoint,
    read_checkpoint,
    save_deepspeed_checkpoint,
)

__all__ = [
    # writing for DeepSpeed
    "save_deepspeed_checkpoint",
    "DEEPSPEED_VERSION",
    # reading DeepSpeed's (engine.load_checkpoint does this by itself)
    "is_deepspeed_checkpoint",
    "read_checkpoint",
    "DeepSpeedState",
    "DeepSpeedCheckpointError",
]
