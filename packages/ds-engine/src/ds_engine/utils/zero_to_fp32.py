"""``deepspeed.utils.zero_to_fp32``: one fp32 state dict from a ZeRO checkpoint, over ds-zero's
consolidation (``ds_zero.consolidate``, ``lazy_fp32_state_dict``, ``export_safetensors``), and
DeepSpeed's script: ``python -m ds_engine.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR
[-t TAG] [--safe_serialization] [--max_shard_size 5GB] [--exclude_frozen_parameters]``.

These read checkpoints written by ds (``engine.save_checkpoint`` or
``ds_zero.save_sharded_checkpoint``) of any stage and world size, and ZeRO checkpoints (stages
1-3) DeepSpeed wrote (read without running code by ``ds_engine._deepspeed_ckpt``). ``get_model_state_file``,
``get_optim_files`` and ``get_model_state_files`` find DeepSpeed's file names as DeepSpeed's do
(Lightning calls them).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import ds_zero
from ds_engine._autotp_checkpoint import merged_tp_fp32_state_dict
from ds_engine._deepspeed_ckpt import deepspeed_tag_dir, is_deepspeed_checkpoint, read_checkpoint

__all__ = [
    "main",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "to_torch_tensor",
    # DeepSpeed's file helpers (Lightning imports them)
    "get_checkpoint_files",
    "get_model_state_file",
    "get_model_state_files",
    "get_optim_files",
    "natural_keys",
]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def natural_keys(text: str) -> list[Any]:
    """Sort key putting ``rank_2`` before ``rank_10``."""
    return [int(c) if c.isdigit() else c for c in re.split(r"(\d+)", text)]


def get_checkpoint_files(checkpoint_dir: str | os.PathLike[str], glob_pattern: str) -> list[str]:
    """The files of ``checkpoint_dir`` matching ``glob_pattern``, in natural order; a
    ``FileNotFoundError`` naming the pattern and folder when there are none."""
    found = sorted(glob.glob(os.path.join(checkpoint_dir, glob_pattern)), key=natural_keys)
    if not found:
        raise FileNotFoundError(f"can't find {glob_pattern} files in directory '{checkpoint_dir}'")
    return found


def get_optim_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """DeepSpeed's ``*_optim_states.pt`` files of a tag folder. ds's own ZeRO checkpoints keep
    the optimizer in ``zero/`` instead, so for them this raises ``FileNotFoundError``."""
    return get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """The ``*_model_states.pt`` files of a tag folder."""
    return get_checkpoint_files(checkpoint_dir, "*_model_states.pt")


def get_model_state_file(checkpoint_dir: str | os.PathLike[str], zero_stage: int) -> str:
    """The model-states file of a tag folder: ``mp_rank_00_model_states.pt`` (stages 0-2, and
    every ds checkpoint) or DeepSpeed's stage 3 ``zero_pp_rank_0_mp_rank_00_model_states.pt``."""
    if not os.path.isdir(checkpoint_dir):
        raise FileNotFoundError(f"Directory '{checkpoint_dir}' doesn't exist")
    names = ["mp_rank_00_model_states.pt"]
    if zero_stage == 3:
        names.insert(0, "zero_pp_rank_0_mp_rank_00_model_states.pt")
    for name in names:
        path = os.path.join(checkpoint_dir, name)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(
        f"can't find model states file at '{os.path.join(checkpoint_dir, names[0])}'"
    )


def to_torch_tensor(
    state_dict: Mapping[str, Any], return_empty_tensor: bool = False, dtype: Any = None
) -> dict[str, torch.Tensor]:
    """Materialise a lazy state dict (``lazy_mode=True``): every value's ``contiguous()``, or
    with ``return_empty_tensor`` an empty tensor of its shape (for planning shards); floating
    tensors cast to ``dtype`` when given. Tied names stay one tensor."""
    target = _output_dtype(dtype) if dtype is not None else None
    out: dict[str, torch.Tensor] = {}
    done: dict[int, str] = {}
    for name, value in state_dict.items():
        if id(value) in done:
            out[name] = out[done[id(value)]]
            continue
        done[id(value)] = name
        cast = target if target is not None and value.dtype.is_floating_point else value.dtype
        if return_empty_tensor:
            out[name] = torch.empty(value.shape, dtype=cast)
        else:
            out[name] = value.contiguous().to(cast)
    return out


class _Loaded:
    """A tensor already in memory, behind the lazy interface (``contiguous()``)."""

    def __init__(self, value: torch.Tensor) -> None:
        self._value, self.shape, self.dtype = value, value.shape, value.dtype

    def contiguous(self) -> torch.Tensor:
        return self._value.clone()


def _deepspeed_fp32(
    checkpoint_dir: str | os.PathLike[str], tag: str | None, exclude_frozen: bool
) -> dict[str, torch.Tensor] | None:
    """The fp32 state dict of a DeepSpeed-written ZeRO checkpoint; None for ds's own."""
    root = Path(checkpoint_dir)
    path = deepspeed_tag_dir(root, tag)
    if path is None and tag is None and is_deepspeed_checkpoint(root):
        path = root
    if path is None:
        return None
    state = read_checkpoint(path, [])
    if not state.fp32:
        raise ValueError(
            f"{str(path)!r} is a DeepSpeed checkpoint without ZeRO optimizer files (stage 0): "
            "its mp_rank_00_model_states.pt 'module' already holds the whole weights"
        )
    shapes = {n: s for group in state.engine.get("param_shapes") or [] for n, s in group.items()}
    frozen = set(state.engine.get("frozen_param_shapes") or {}) if exclude_frozen else set()
    out: dict[str, torch.Tensor] = {}
    for name, value in state.module.items():
        if name in state.fp32:
            out[name] = state.fp32[name].view(tuple(shapes.get(name, value.shape)))
        elif name not in frozen and torch.is_tensor(value):
            out[name] = value.float() if value.is_floating_point() else value
    for alias, name in state.engine.get("shared_params") or []:
        if name in out:
            out[alias] = out[name]
    return out


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, Any]:
    """The fp32 state dict (on CPU) of a ZeRO checkpoint, for ``model.load_state_dict``.

    Args:
        checkpoint_dir: the engine's ``save_dir`` (holding ``latest``) or a tag directory.
        tag: the checkpoint tag (default: the one ``latest`` names).
        exclude_frozen_parameters: leave out parameters saved with ``requires_grad=False``
            (buffers stay).
        lazy_mode: return name -> a lazy tensor whose ``contiguous()`` reads it (nothing is read
            before); :func:`to_torch_tensor` materialises such a dict. (An AutoTP checkpoint's
            tensor-parallel shards are read and merged at once, then wrapped.)

    Example:
        >>> state = get_fp32_state_dict_from_zero_checkpoint("ckpts")
        >>> model.cpu().load_state_dict(state)
    """
    deepspeed = _deepspeed_fp32(checkpoint_dir, tag, exclude_frozen_parameters)
    if deepspeed is None:  # AutoTP: every tp rank's zero_mp folder, merged (eagerly)
        deepspeed = merged_tp_fp32_state_dict(checkpoint_dir, tag, exclude_frozen_parameters)
    if deepspeed is not None:
        if not lazy_mode:
            return deepspeed
        loaded: dict[int, _Loaded] = {}
        return {k: loaded.setdefault(id(v), _Loaded(v)) for k, v in deepspeed.items()}
    if lazy_mode:
        return ds_zero.lazy_fp32_state_dict(
            checkpoint_dir, tag=tag, exclude_frozen_parameters=exclude_frozen_parameters
        )
    return ds_zero.consolidate(
        checkpoint_dir,
        tag=tag,
        progress=False,
        exclude_frozen_parameters=exclude_frozen_parameters,
    )


def _bytes(size: int | str) -> int:
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size)
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"max_shard_size = {size!r}: expected bytes or e.g. '5GB', '500MiB'")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"max_shard_size = {size!r}: expected more than 0 bytes")
    return value


def _shards(state: Mapping[str, torch.Tensor], limit: int | None) -> list[list[str]]:
    """Greedy file plan in model order, as ``huggingface_hub``'s split (a tensor larger than
    ``limit`` gets a file of its own; a tied tensor counts once)."""
    if limit is None:
        return [list(state)]
    files: list[list[str]] = [[]]
    used, seen = 0, set()
    for name, value in state.items():
        size = 0 if id(value) in seen else value.numel() * value.element_size()
        seen.add(id(value))
        if files[-1] and used + size > limit:
            files.append([])
            used = 0
        files[-1].append(name)
        used += size
    return files


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def _output_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.").lower()
        if name not in _DTYPES:
            raise ValueError(f"dtype = {dtype!r}: choose one of {sorted(_DTYPES)}")
        return _DTYPES[name]
    if dtype not in set(_DTYPES.values()):
        raise ValueError(f"dtype = {dtype!r}: choose torch.float32, torch.float16 or bfloat16")
    return dtype


def convert_zero_checkpoint_to_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    dtype: torch.dtype | str = torch.float32,
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """Write a ZeRO checkpoint as weight files in ``output_dir``, floating tensors cast to
    ``dtype`` (float32, float16 or bfloat16; other tensors keep theirs), named as DeepSpeed and
    transformers name them: ``pytorch_model.bin`` (or ``pytorch_model-0000i-of-0000N.bin`` plus
    ``pytorch_model.bin.index.json`` above ``max_shard_size``), or with ``safe_serialization``
    ``model.safetensors`` (sharded likewise).

    Example:
        >>> convert_zero_checkpoint_to_state_dict("ckpts", "export", dtype="bf16")
    """
    dtype = _output_dtype(dtype)
    out = Path(output_dir)
    lazy = get_fp32_state_dict_from_zero_checkpoint(
        checkpoint_dir, tag, exclude_frozen_parameters, lazy_mode=True
    )
    if safe_serialization:
        limit: int | str = max_shard_size if max_shard_size is not None else 2**62
        ds_zero.export_safetensors(lazy, out, max_shard_size=limit, dtype=dtype, progress=False)
        return
    planned = to_torch_tensor(lazy, return_empty_tensor=True, dtype=dtype)
    files = _shards(planned, _bytes(max_shard_size) if max_shard_size is not None else None)
    out.mkdir(parents=True, exist_ok=True)
    names = ["pytorch_model.bin"] if len(files) == 1 else []
    names = names or [
        f"pytorch_model-{i:05d}-of-{len(files):05d}.bin" for i in range(1, len(files) + 1)
    ]
    for stale in (*out.glob("pytorch_model-*-of-*.bin"), out / "pytorch_model.bin.index.json"):
        stale.unlink(missing_ok=True)
    for name, keys in zip(names, files):  # one file's tensors in memory at a time
        torch.save(to_torch_tensor({k: lazy[k] for k in keys}, dtype=dtype), out / name)
    if len(files) > 1:
        unique = {id(v): v for v in planned.values()}.values()
        total = sum(v.numel() * v.element_size() for v in unique)
        weight_map = {k: name for name, keys in zip(names, files) for k in keys}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        (out / "pytorch_model.bin.index.json").write_text(text)


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> None:
    """:func:`convert_zero_checkpoint_to_state_dict` in fp32.

    Example:
        >>> convert_zero_checkpoint_to_fp32_state_dict("ckpts", "export", tag="global_step100")
    """
    convert_zero_checkpoint_to_state_dict(
        checkpoint_dir,
        output_dir,
        dtype=torch.float32,
        max_shard_size=max_shard_size,
        safe_serialization=safe_serialization,
        tag=tag,
        exclude_frozen_parameters=exclude_frozen_parameters,
    )


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir: str | os.PathLike[str], tag: str | None = None
) -> torch.nn.Module:
    """Move ``model`` to the CPU and load the checkpoint's fp32 weights into it (non-strict, as
    DeepSpeed's); returns the model. The model leaves any ds engine it was in: build a new
    engine to train it again.

    Example:
        >>> model = load_state_dict_from_zero_checkpoint(model, "ckpts")
    """
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def main(argv: Sequence[str] | None = None) -> int:
    """DeepSpeed's ``zero_to_fp32.py`` command line."""
    parser = argparse.ArgumentParser(
        prog="zero_to_fp32",
        description="Write a ds ZeRO checkpoint as fp32 weight files (DeepSpeed's zero_to_fp32.py).",
        allow_abbrev=False,
    )
    parser.add_argument("checkpoint_dir", help="the save_dir holding 'latest', or a tag folder")
    parser.add_argument("output_dir", help="folder for pytorch_model.bin / model.safetensors")
    parser.add_argument("--max_shard_size", default="5GB", help="largest file (default 5GB)")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: latest)")
    parser.add_argument("--dtype", default="float32", help="float32 (default), float16 or bfloat16")
    parser.add_argument(
        "--exclude_frozen_parameters", action="store_true", help="exclude frozen parameters"
    )
    parser.add_argument("-d", "--debug", action="store_true", help="accepted; prints nothing more")
    args = parser.parse_args(argv)
    convert_zero_checkpoint_to_state_dict(
        args.checkpoint_dir,
        args.output_dir,
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        safe_serialization=args.safe_serialization,
        tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
