#!/usr/bin/env python
"""zero_to_fp32.py: the fp32 weights of a ds ZeRO checkpoint, without ds installed.

ds writes this file next to ``latest`` in every ZeRO checkpoint folder, as DeepSpeed copies its
``zero_to_fp32.py`` there, so the weights can be recovered with only ``torch`` (and, for
``--safe_serialization``, ``safetensors``) installed::

    python zero_to_fp32.py . pytorch_model_dir                  # the tag 'latest' names
    python zero_to_fp32.py . out -t global_step100 --safe_serialization --max_shard_size 2GB
    python zero_to_fp32.py . out --exclude_frozen_parameters

The output is what DeepSpeed's script writes: ``pytorch_model.bin`` (or
``pytorch_model-0000i-of-0000N.bin`` plus ``pytorch_model.bin.index.json`` above
``--max_shard_size``), or ``model.safetensors`` (sharded likewise), which
``transformers``' ``from_pretrained`` reads.

Layout read: ``<tag>/zero/manifest.json`` lists, for every trainable tensor, the pieces
``[file, key, start, stop]`` (elements ``[start, stop)`` of the flattened fp32 master are
``file[key + "/param"]``); ``<tag>/mp_rank_00_model_states.pt`` holds the buffers and frozen
parameters. Files are opened with ``torch.load(weights_only=True)``: they cannot run code.
This file imports nothing from ds on purpose; keep it that way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import zlib

import torch

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16}
_DTYPES.update({"fp16": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16})


def _load(path):
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


def tag_directory(checkpoint_dir, tag=None):
    """``checkpoint_dir/<tag>`` (``tag`` from the ``latest`` file when None)."""
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if not os.path.isfile(latest):
            raise ValueError(f"no 'latest' file in {checkpoint_dir!r}: pass the tag with -t")
        with open(latest) as f:
            tag = f.read().strip()
    path = os.path.join(checkpoint_dir, tag)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint folder {path!r} does not exist (tag {tag!r})")
    return path


def _zero_dirs(path):
    names = sorted(n for n in os.listdir(path) if n == "zero" or n.startswith("zero_mp"))
    found = [n for n in names if os.path.isfile(os.path.join(path, n, "manifest.json"))]
    if not found:
        raise FileNotFoundError(
            f"no zero/manifest.json in {path!r}: not a ds ZeRO checkpoint (a DeepSpeed-written "
            "checkpoint comes with DeepSpeed's own zero_to_fp32.py)"
        )
    if len(found) > 1:
        raise ValueError(
            f"{path!r} holds {len(found)} model-parallel ZeRO folders ({', '.join(found)}): a "
            "tensor-parallel (AutoTP) checkpoint, whose shards must be merged by its tp_layout; "
            "this script takes one model-parallel rank only: install ds and use "
            "deepspeed.utils.zero_to_fp32, which merges them"
        )
    return found


def _digests(path, chunk):
    """The file's sha256 and the CRC-32 of each ``chunk`` bytes."""
    sha, crcs = hashlib.sha256(), []
    with open(path, "rb") as f:
        while block := f.read(chunk):
            sha.update(block)
            crcs.append(zlib.crc32(block))
    return sha.hexdigest(), crcs or [0]


def _verify(zero, manifest):
    """Every listed file present, of its recorded size and checksums (sha256 or 16 MiB-chunk
    CRC-32, whichever the manifest records)."""
    for file, record in manifest["files"].items():
        path = os.path.join(zero, file)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path} is missing: the checkpoint is incomplete")
        if os.path.getsize(path) != record["bytes"]:
            raise ValueError(f"{path} is truncated ({os.path.getsize(path)} of {record['bytes']})")
        sha, crcs = _digests(path, int(manifest.get("chunk", 16 << 20)))
        if record.get("sha256", sha) != sha or record.get("crc32", crcs) != crcs:
            raise ValueError(f"{path} is corrupted: its checksum differs from the manifest's")


def _assemble(zero, entry, files):
    numel = 1
    for size in entry["shape"]:
        numel *= int(size)
    out = torch.empty(numel, dtype=torch.float32)
    covered = 0
    for file, key, start, stop in entry["pieces"]:
        if start >= stop:
            continue
        if file not in files:
            files[file] = _load(os.path.join(zero, file))
        out[start:stop].copy_(files[file][f"{key}/param"])
        covered += stop - start
    if covered != numel:
        raise ValueError(f"only {covered} of {numel} elements are in the checkpoint")
    return out.view([int(s) for s in entry["shape"]])


def _model_file(path, zero_name):
    mp = "00" if zero_name == "zero" else zero_name.removeprefix("zero_mp")
    file = os.path.join(path, f"mp_rank_{mp}_model_states.pt")
    return _load(file) if os.path.isfile(file) else {}


def get_fp32_state_dict(checkpoint_dir, tag=None, exclude_frozen_parameters=False):
    """Parameter and buffer name -> fp32 tensor (CPU) of a ds ZeRO checkpoint."""
    path = tag_directory(checkpoint_dir, tag)
    state = {}
    for zero_name in _zero_dirs(path):
        zero = os.path.join(path, zero_name)
        with open(os.path.join(zero, "manifest.json")) as f:
            manifest = json.load(f)
        _verify(zero, manifest)
        saved = _model_file(path, zero_name)
        module = saved.get("module", {})
        if exclude_frozen_parameters and "buffer_names" not in saved and module:
            raise ValueError(
                "this checkpoint does not record which of its tensors are buffers, so frozen "
                "parameters cannot be told apart; run without --exclude_frozen_parameters"
            )
        frozen = set(saved.get("frozen_param_shapes", {})) if exclude_frozen_parameters else set()
        files = {}
        for name, entry in manifest["tensors"].items():
            if name not in frozen:
                state[name] = _assemble(zero, entry, files)
        for alias, name in manifest.get("aliases", {}).items():
            if name in state:
                state[alias] = state[name]
        for name, value in module.items():
            if name in state or name in frozen or not torch.is_tensor(value):
                continue
            state[name] = value.float().clone() if value.is_floating_point() else value.clone()
    return state


def parse_size(size):
    """Bytes in ``"5GB"`` / ``"500MiB"`` / an int."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
    if match is None or match.group(2).upper() not in _UNITS:
        raise ValueError(f"max_shard_size = {size!r}: expected bytes or e.g. '5GB', '500MiB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def plan_shards(state, limit):
    """Greedy file plan in state order (a tensor larger than ``limit`` gets a file of its own);
    tied tensors are counted and stored once."""
    files, used, seen = [[]], 0, set()
    for name, value in state.items():
        size = 0 if id(value) in seen else value.numel() * value.element_size()
        seen.add(id(value))
        if files[-1] and used + size > limit:
            files.append([])
            used = 0
        files[-1].append(name)
        used += size
    return files


def save_state_dict(state, output_dir, max_shard_size="5GB", safe_serialization=False):
    """Write ``state`` as ``transformers`` names weight files, with an index when sharded."""
    stem, ext = ("model", "safetensors") if safe_serialization else ("pytorch_model", "bin")
    limit = parse_size(max_shard_size) if max_shard_size is not None else float("inf")
    plan = plan_shards(state, limit)
    os.makedirs(output_dir, exist_ok=True)
    names = [f"{stem}.{ext}"] if len(plan) == 1 else []
    names = names or [f"{stem}-{i:05d}-of-{len(plan):05d}.{ext}" for i in range(1, len(plan) + 1)]
    weight_map, total, seen = {}, 0, set()
    for file, keys in zip(names, plan):
        part = {k: state[k] for k in keys}
        if safe_serialization:
            from safetensors.torch import save_file  # pyright: ignore[reportMissingImports]  (optional extra)

            first = {}
            for k, v in part.items():  # safetensors stores shared tensors once
                first.setdefault(id(v), k)
            part = {k: v.contiguous() for k, v in part.items() if first[id(v)] == k}
            keys = list(part)
            save_file(part, os.path.join(output_dir, file), metadata={"format": "pt"})
        else:
            torch.save(part, os.path.join(output_dir, file))
        for k in keys:
            weight_map[k] = file
            if id(state[k]) not in seen:
                seen.add(id(state[k]))
                total += state[k].numel() * state[k].element_size()
    if len(plan) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(output_dir, f"{stem}.{ext}.index.json"), "w") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return [os.path.join(output_dir, n) for n in names]


def main(argv=None):
    parser = argparse.ArgumentParser(description="fp32 weights of a ds ZeRO checkpoint")
    parser.add_argument("checkpoint_dir", help="the folder holding 'latest' (e.g. '.')")
    parser.add_argument("output_dir", help="folder for pytorch_model.bin / model.safetensors")
    parser.add_argument("--max_shard_size", default="5GB", help="largest file (default 5GB)")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: latest)")
    parser.add_argument("--dtype", default="float32", help="float32, float16 or bfloat16")
    parser.add_argument("--exclude_frozen_parameters", action="store_true")
    parser.add_argument("-d", "--debug", action="store_true", help="print each tensor")
    args = parser.parse_args(argv)
    if args.dtype.removeprefix("torch.").lower() not in _DTYPES:
        parser.error(f"--dtype {args.dtype}: choose one of {sorted(_DTYPES)}")
    dtype = _DTYPES[args.dtype.removeprefix("torch.").lower()]
    state = get_fp32_state_dict(args.checkpoint_dir, args.tag, args.exclude_frozen_parameters)
    cast = {}
    for name, value in state.items():
        if value.is_floating_point():
            state[name] = cast.setdefault(id(value), value.to(dtype))
        if args.debug:
            print(f"{name}: {tuple(value.shape)}")
    for path in save_state_dict(
        state, args.output_dir, args.max_shard_size, args.safe_serialization
    ):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
