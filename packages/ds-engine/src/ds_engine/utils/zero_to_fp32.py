"""``deepspeed.utils.zero_to_fp32``: one fp32 state dict from a ZeRO checkpoint, over ds-zero's
consolidation (``ds_zero.consolidate``, ``export_safetensors``), and DeepSpeed's script:
``python -m ds_engine.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [-t TAG]
[--safe_serialization] [--max_shard_size 5GB]``.

These read checkpoints written by ds (``engine.save_checkpoint`` or
``ds_zero.save_sharded_checkpoint``) of any stage and world size. Checkpoints written by
DeepSpeed itself (``*_optim_states.pt`` of its own layout) are not read yet, nor are the
DeepSpeed-layout helpers that parse them (``get_optim_files``, ``get_model_state_file``,
``parse_optim_states``), which Lightning's ``convert_zero_checkpoint_to_fp32_state_dict`` uses.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import torch

import ds_zero

__all__ = [
    "main",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def _refuse(exclude_frozen_parameters: bool, lazy_mode: bool = False) -> None:
    if exclude_frozen_parameters:
        raise NotImplementedError(
            "exclude_frozen_parameters=True is not implemented in ds: the consolidated state "
            "dict holds frozen parameters too; drop their names from it afterwards"
        )
    if lazy_mode:
        raise NotImplementedError(
            "lazy_mode=True is not implemented in ds; stream the tensors one at a time with "
            "ds_zero.iter_fp32_tensors(checkpoint_dir, tag=tag) instead"
        )


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir: str | os.PathLike[str],
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    lazy_mode: bool = False,
) -> dict[str, torch.Tensor]:
    """The fp32 state dict (on CPU) of a ds ZeRO checkpoint, for ``model.load_state_dict``.

    Args:
        checkpoint_dir: the engine's ``save_dir`` (holding ``latest``) or a tag directory.
        tag: the checkpoint tag (default: the one ``latest`` names).
        exclude_frozen_parameters: not implemented (refused).
        lazy_mode: not implemented (refused; see ``ds_zero.iter_fp32_tensors``).

    Example:
        >>> state = get_fp32_state_dict_from_zero_checkpoint("ckpts")
        >>> model.cpu().load_state_dict(state)
    """
    _refuse(exclude_frozen_parameters, lazy_mode)
    return ds_zero.consolidate(checkpoint_dir, tag=tag, progress=False)


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


def _shards(state: dict[str, torch.Tensor], limit: int | None) -> list[list[str]]:
    if limit is None:
        return [list(state)]
    files: list[list[str]] = [[]]
    used = 0
    for name, value in state.items():
        size = value.numel() * value.element_size()
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
    """Write a ds ZeRO checkpoint as weight files in ``output_dir``, floating tensors cast to
    ``dtype`` (float32, float16 or bfloat16; other tensors keep theirs), named as DeepSpeed and
    transformers name them: ``pytorch_model.bin`` (or ``pytorch_model-0000i-of-0000N.bin`` plus
    ``pytorch_model.bin.index.json`` above ``max_shard_size``), or with ``safe_serialization``
    ``model.safetensors`` (sharded likewise).

    Example:
        >>> convert_zero_checkpoint_to_state_dict("ckpts", "export", dtype="bf16")
    """
    _refuse(exclude_frozen_parameters)
    dtype = _output_dtype(dtype)
    out = Path(output_dir)
    if safe_serialization:
        source = Path(checkpoint_dir) / tag if tag else Path(checkpoint_dir)
        limit: int | str = max_shard_size if max_shard_size is not None else 2**62
        ds_zero.export_safetensors(source, out, max_shard_size=limit, dtype=dtype, progress=False)
        return
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=tag)
    cast: dict[int, torch.Tensor] = {}  # tied tensors stay one tensor
    for name, value in state.items():
        if value.is_floating_point():
            state[name] = cast.setdefault(id(value), value.to(dtype))
    files = _shards(state, _bytes(max_shard_size) if max_shard_size is not None else None)
    out.mkdir(parents=True, exist_ok=True)
    if len(files) == 1:
        torch.save(state, out / "pytorch_model.bin")
        return
    weight_map = {}
    for i, names in enumerate(files, 1):
        name = f"pytorch_model-{i:05d}-of-{len(files):05d}.bin"
        torch.save({n: state[n] for n in names}, out / name)
        weight_map.update(dict.fromkeys(names, name))
    total = sum(v.numel() * v.element_size() for v in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


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
        "--exclude_frozen_parameters", action="store_true", help="not implemented in ds"
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
