"""Offline consolidation of an AutoTP checkpoint: one fp32 state dict from every tp rank's ZeRO
shards (``zero_mp<tp>/``), merged by the ``tp_layout`` the engine saved in the model file.

[Note: merging tensor-parallel checkpoints]
Under ``tensor_parallel.autotp_size`` the engine writes one ``mp_rank_<tp>_model_states.pt`` and
one ``zero_mp<tp>/`` folder per tensor-parallel rank (see ``_checkpoint.py``); each folder's fp32
masters are that rank's shards. ``mp_rank_00_model_states.pt`` also holds ``tp_layout``: for
every sharded parameter its split dimension, fused parts and tp size (``_autotp.tp_layout``).
ds-zero consolidates each folder on its own; :func:`_autotp.merge_tp_state_dicts` puts the
shards back together. A checkpoint with several ``zero_mp`` folders but no ``tp_layout`` (a
client's own model parallelism through an ``mpu``) cannot be merged without knowing the split,
and is refused rather than returned as tp rank 0's shards.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

import ds_zero
from ds_engine._autotp import merge_tp_state_dicts

__all__ = ["merged_tp_fp32_state_dict"]


def _tag_dir(checkpoint_dir: str | os.PathLike[str], tag: str | None) -> Path:
    root = Path(checkpoint_dir)
    latest = root / "latest"
    if tag is None and latest.is_file():
        tag = latest.read_text().strip()
    return root / tag if tag else root


def merged_tp_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> dict[str, torch.Tensor] | None:
    """The merged fp32 state dict of a model-parallel ds checkpoint (see [Note: merging
    tensor-parallel checkpoints]); None when the checkpoint has one ``zero``/``zero_mp`` folder.

    Raises:
        ValueError: several ``zero_mp`` folders and no ``tp_layout`` to merge them by.
    """
    base = _tag_dir(checkpoint_dir, tag)
    folders = sorted(base.glob("zero_mp*"))
    if len(folders) <= 1:
        return None
    model_file = base / "mp_rank_00_model_states.pt"
    saved: Any = torch.load(model_file, map_location="cpu", weights_only=True, mmap=True)
    layout = saved.get("tp_layout") if isinstance(saved, dict) else None
    if not layout:
        raise ValueError(
            f"{str(base)!r} holds {len(folders)} model-parallel ZeRO folders "
            f"({', '.join(f.name for f in folders)}) but no tp_layout: the split of its "
            "model-parallel parameters is unknown, so they cannot be merged into one state "
            "dict; consolidate each zero_mp folder with ds_zero.consolidate and merge them "
            "with your model's own rule"
        )
    states = [
        ds_zero.consolidate(
            folder, progress=False, exclude_frozen_parameters=exclude_frozen_parameters
        )
        for folder in folders
    ]
    return merge_tp_state_dicts(states, layout)
