"""DeepSpeed-written checkpoints: read them into ds, and write ds's state in DeepSpeed's layout."""

from __future__ import annotations

from ds_engine._deepspeed_ckpt._load import (
    load_deepspeed_checkpoint,
    load_deepspeed_pipeline_checkpoint,
)
from ds_engine._deepspeed_ckpt._pickle import DeepSpeedCheckpointError, load_file
from ds_engine._deepspeed_ckpt._read import (
    DeepSpeedState,
    deepspeed_tag_dir,
    is_deepspeed_checkpoint,
    read_checkpoint,
)
from ds_engine._deepspeed_ckpt._write import DEEPSPEED_VERSION, save_deepspeed_checkpoint

__all__ = [
    # reading
    "is_deepspeed_checkpoint",
    "deepspeed_tag_dir",
    "read_checkpoint",
    "load_deepspeed_checkpoint",
    "load_deepspeed_pipeline_checkpoint",
    "load_file",
    "DeepSpeedState",
    "DeepSpeedCheckpointError",
    # writing
    "save_deepspeed_checkpoint",
    "DEEPSPEED_VERSION",
]
