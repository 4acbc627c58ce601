"""Per-layer checkpoint files: one ``layer_XX[-model_YY]-model_states.pt`` per layer.

Files are named by the layer's global index in ``layers``, never by stage, so a pipeline saved
with one number of stages loads with another, and into a plain module list
(:func:`load_layers_into`). A tied layer (``TiedLayerSpec``) is stored once, under the index of
its key's first occurrence; every stage holding the key loads that file.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "layer_checkpoint_name",
    "load_layer_state",
    "load_layers_into",
    "save_layer_state",
]


def layer_checkpoint_name(layer_idx: int, rank_repr: str = "") -> str:
    """``layer_{idx:02d}[-{rank_repr}]-model_states.pt`` (DeepSpeed's file name).

    ``rank_repr`` names the model-parallel coordinate (``model_01``); empty without one.

    Example:
        >>> layer_checkpoint_name(3), layer_checkpoint_name(12, "model_01")
        ('layer_03-model_states.pt', 'layer_12-model_01-model_states.pt')
    """
    middle = f"-{rank_repr}" if rank_repr else ""
    return f"layer_{layer_idx:02d}{middle}-model_states.pt"


def save_layer_state(module: nn.Module, path: str | os.PathLike[str]) -> None:
    """Write ``module.state_dict()`` to ``path`` as CPU copies, atomically (temp file + rename).

    Copies detach views from larger storages (flat buffers), so each file holds only its layer.
    """
    state = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_layer_state(module: nn.Module, path: str | os.PathLike[str], strict: bool = True) -> None:
    """Load one layer file into ``module`` (onto the module's own devices)."""
    if not os.path.exists(path):
        folder = Path(path).parent
        found = sorted(p.name for p in folder.glob("layer_*-model_states.pt"))[:8]
        raise FileNotFoundError(
            f"layer checkpoint {str(path)!r} does not exist; {folder} holds {found or 'no layer files'}"
            " -- was it saved from the same `layers` list (layer indices name the files)?"
        )
    state: Mapping[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    module.load_state_dict(state, strict=strict)


def load_layers_into(
    layers: nn.Sequential | Sequence[nn.Module | Callable[..., Any] | None],
    ckpt_dir: str | os.PathLike[str],
    strict: bool = True,
    rank_repr: str = "",
) -> list[int]:
    """Load a pipeline's per-layer checkpoint into a plain sequence of modules.

    ``layers[i]`` receives ``layer_{i:02d}-model_states.pt``, so the sequence must line up with
    the ``layers`` list the pipeline was built from. Entries that are not modules (callables,
    ``None``) are skipped, and a module appearing more than once (a tied embedding reused as the
    unembedding) loads once, from its first index, where the pipeline saved it. A module without
    state and without a file (``nn.ReLU`` where the pipeline had ``torch.relu``) is skipped.

    Args:
        layers: an ``nn.Sequential`` or list aligned with the pipeline's ``layers``.
        ckpt_dir: the directory ``PipelineModule.save_state_dict`` wrote.
        strict: passed to ``load_state_dict``.
        rank_repr: the model-parallel part of file names (``model_00``); empty without one.

    Returns:
        the indices that were loaded.

    Example:
        >>> model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        >>> load_layers_into(model, "ckpt/global_step10")
        [0, 1, 2]
    """
    seen: set[int] = set()
    loaded = []
    for idx, layer in enumerate(layers):
        if not isinstance(layer, nn.Module) or id(layer) in seen:
            continue
        seen.add(id(layer))
        path = Path(ckpt_dir) / layer_checkpoint_name(idx, rank_repr)
        if not path.exists() and not layer.state_dict():
            continue  # a weightless module (nn.ReLU) where the pipeline had a plain callable
        load_layer_state(layer, path, strict)
        loaded.append(idx)
    return loaded
