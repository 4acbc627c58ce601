"""Hugging Face style ``safetensors`` export, streamed one tensor at a time, from a sharded
checkpoint or from a live (stage 3 partitioned) model.

[Note: safetensors writer]
The format is an 8-byte little-endian header length, a JSON header mapping each tensor name to
``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the data that follows, plus
an optional ``"__metadata__"`` of strings), padded with spaces to a multiple of 8 bytes, then the
raw little-endian bytes of every tensor back to back. Every shape and dtype is known before any
value is (from the manifest, or ``ds_shape`` of partitioned parameters), so the shard plan and
each file's header are written first and the values streamed after it: one tensor is assembled
(or all-gathered) at a time, written, and dropped. Files are cut greedily in model order at
``max_shard_size`` (a larger tensor gets a file of its own) and named as ``transformers`` does:
``model.safetensors`` when one file suffices, else ``model-00001-of-0000N.safetensors`` plus
``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``). Tied parameters are
written once, under their first name, since safetensors forbids shared storage (``transformers``
re-ties them on load). The writer needs no ``safetensors`` package; the tests read the files
with it.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ds_zero._partitioned import ZeroParamStatus, is_partitioned

__all__ = ["export_safetensors", "parse_size"]

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SINGLE = "model.safetensors"
_INDEX = "model.safetensors.index.json"


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or ``"5GB"`` / ``"500MB"`` (powers of 10) / ``"2GiB"``
    (powers of 2), as ``transformers``' ``max_shard_size``."""
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size)
        unit = match.group(2).upper() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"max_shard_size = {size!r}: expected bytes or e.g. '5GB', '500MiB'")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"max_shard_size = {size!r}: expected > 0 bytes")
    return value


@dataclass(frozen=True)
class _Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


def _plan(entries: Sequence[_Entry], max_bytes: int) -> list[list[_Entry]]:
    files: list[list[_Entry]] = [[]]
    used = 0
    for entry in entries:
        if files[-1] and used + entry.nbytes > max_bytes:
            files.append([])
            used = 0
        files[-1].append(entry)
        used += entry.nbytes
    return files


def _header(entries: Sequence[_Entry]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for entry in entries:
        if entry.dtype not in _DTYPES:
            raise ValueError(f"tensor {entry.name!r} has dtype {entry.dtype}: safetensors has none")
        header[entry.name] = {
            "dtype": _DTYPES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [at, at + entry.nbytes],
        }
        at += entry.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _write_file(
    path: Path, entries: Sequence[_Entry], values: Iterator[tuple[str, torch.Tensor]]
) -> None:
    """Write one safetensors file, taking each entry's value from ``values`` in order."""
    temp = path.with_name(f".{path.name}.tmp")
    with open(temp, "wb") as f:
        f.write(_header(entries))
        for entry in entries:
            name, value = next(values)
            if name != entry.name or tuple(value.shape) != entry.shape:
                raise RuntimeError(f"expected tensor {entry.name!r}, got {name!r}")
            data = value.detach().to("cpu", entry.dtype).contiguous()
            f.write(_raw_bytes(data))
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)


def _raw_bytes(data: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (and without numpy)."""
    nbytes = data.numel() * data.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(data.data_ptr())).cast("B")


def _file_names(count: int) -> list[str]:
    if count == 1:
        return [_SINGLE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _write_all(
    out: Path,
    entries: Sequence[_Entry],
    values: Iterator[tuple[str, torch.Tensor]],
    max_bytes: int,
    *,
    writer: bool,
    progress: bool,
) -> list[Path]:
    """Write the planned files (``writer``), or only drive ``values`` (other ranks: they take
    part in the gathers)."""
    from tqdm.auto import tqdm

    plan = _plan(entries, max_bytes)
    names = _file_names(len(plan))
    bar = tqdm(total=len(entries), desc="exporting", unit="tensor", disable=not progress)
    counted = _counted(values, bar)
    if not writer:
        for _ in counted:
            pass
        bar.close()
        return [out / n for n in names]
    out.mkdir(parents=True, exist_ok=True)
    for stale in (*out.glob("model-*-of-*.safetensors"), out / _SINGLE, out / _INDEX):
        stale.unlink(missing_ok=True)
    for name, file_entries in zip(names, plan):
        _write_file(out / name, file_entries, counted)
    bar.close()
    if len(plan) > 1:
        index = {
            "metadata": {"total_size": sum(e.nbytes for e in entries)},
            "weight_map": {e.name: name for name, group in zip(names, plan) for e in group},
        }
        (out / _INDEX).write_text(json.dumps(index, indent=2))
    return [out / n for n in names]


def _counted(values: Iterator[Any], bar: Any) -> Iterator[Any]:
    for value in values:
        yield value
        bar.update(1)


def _live_tensors(module: torch.nn.Module) -> list[tuple[str, Any]]:
    """The module's parameters (first name of tied ones) and persistent buffers."""
    state_names = set(module.state_dict(keep_vars=True))
    named: list[tuple[str, Any]] = list(module.named_parameters())
    named += [(n, b) for n, b in module.named_buffers() if n in state_names]
    return named


def _gathered(named: Sequence[tuple[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor's whole value; partitioned ones gathered just for their turn (every rank)."""
    for name, p in named:
        if not is_partitioned(p) or p.ds_status is ZeroParamStatus.AVAILABLE:
            yield name, p.detach()
            continue
        p.ds_partitioner.gather([p]).wait()
        try:
            yield name, p.detach()
        finally:
            p.ds_partitioner.release([p])


def _mapping_entries(
    source: Mapping[str, Any], cast: Any
) -> tuple[list[_Entry], Iterator[tuple[str, torch.Tensor]]]:
    """Entries and values of a name -> tensor (or lazy tensor) mapping, a tied value once."""
    first: dict[int, str] = {}
    for name, value in source.items():
        first.setdefault(id(value), name)
    names = [n for n, v in source.items() if first[id(v)] == n]
    entries = [_Entry(n, tuple(source[n].shape), cast(source[n].dtype)) for n in names]
    return entries, ((n, source[n].contiguous()) for n in names)


def _refuse_split_experts(module: torch.nn.Module) -> None:
    """A live model whose MoE experts are split over ranks (DeepSpeed's ``group_name``
    ``ep_size_<n>``, n > 1) holds only this rank's experts, under local names: writing it would
    silently leave the others out."""
    split = sorted(
        {
            name
            for p in module.parameters()
            if isinstance(name := getattr(p, "group_name", None), str)
            and name.startswith("ep_size_")
            and name.removeprefix("ep_size_").isdigit()
            and int(name.removeprefix("ep_size_")) > 1
        }
    )
    if split:
        raise ValueError(
            f"export_safetensors: the model's MoE experts are split over ranks ({', '.join(split)})"
            ", so this rank holds only its own experts; export the whole model's state dict "
            "instead (ds-engine: engine._zero3_consolidated_16bit_state_dict() on every rank, "
            "then export_safetensors(that dict, ...) on rank 0; docs/moe.md)"
        )


def export_safetensors(
    source: str | os.PathLike[str] | Mapping[str, Any] | torch.nn.Module | Any,
    out_dir: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    progress: bool = True,
    exclude_frozen_parameters: bool = False,
) -> list[Path]:
    """Write ``source``'s weights as Hugging Face style safetensors files, one tensor at a time
    (see [Note: safetensors writer]).

    Args:
        source: a sharded checkpoint directory (or ds-engine ``save_dir``/tag directory), a
            name -> tensor mapping (values may be lazy: anything with ``shape``, ``dtype`` and
            ``contiguous()``, read one at a time), or a live model (a module, or an optimizer
            with ``.module``). A live stage 3 model is
            gathered one parameter at a time and every rank of its group must call this; rank 0
            writes.
        out_dir: the folder for ``model.safetensors`` or ``model-0000i-of-0000N.safetensors``
            and ``model.safetensors.index.json``.
        max_shard_size: largest file (``"5GB"``, ``"500MiB"`` or bytes).
        dtype: cast every floating-point tensor to it (None: each tensor's model dtype).
        progress: show a tqdm progress bar.
        exclude_frozen_parameters: leave out frozen parameters (a checkpoint: those its
            model file lists; a live model: ``requires_grad=False``).

    Returns:
        The files written (on every rank).

    Example:
        >>> export_safetensors("ckpts/global_step100/zero", "hf_model", max_shard_size="2GB")
    """
    out, max_bytes = Path(out_dir), parse_size(max_shard_size)

    def cast(d: torch.dtype) -> torch.dtype:
        return dtype if dtype is not None and d.is_floating_point else d

    if isinstance(source, Mapping):
        entries, values = _mapping_entries(source, cast)
        return _write_all(out, entries, values, max_bytes, writer=True, progress=progress)
    if isinstance(source, (str, os.PathLike)):
        from ds_zero._checkpoint import verify_checkpoint
        from ds_zero._consolidate import checkpoint_tensors, resolve_checkpoint_dir
        from ds_zero._ranks import THIS_PROCESS

        directory = resolve_checkpoint_dir(source)
        manifest = verify_checkpoint(directory, group=THIS_PROCESS)  # one rank may export alone
        listed, values = checkpoint_tensors(
            directory, manifest, exclude_frozen=exclude_frozen_parameters
        )
        entries = [_Entry(n, shape, cast(d)) for n, shape, d in listed]
        return _write_all(out, entries, values, max_bytes, writer=True, progress=progress)
    module = source if isinstance(source, torch.nn.Module) else getattr(source, "module", None)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"source is a {type(source).__name__}: pass a checkpoint directory, a module, or an "
            "optimizer with a .module"
        )
    _refuse_split_experts(module)
    named = _live_tensors(module)
    if exclude_frozen_parameters:
        frozen = {id(p) for p in module.parameters() if not p.requires_grad}
        named = [(n, p) for n, p in named if id(p) not in frozen]
    entries = [
        _Entry(n, tuple(p.ds_shape) if is_partitioned(p) else tuple(p.shape), cast(p.dtype))
        for n, p in named
    ]
    partitioner = next((p.ds_partitioner for _, p in named if is_partitioned(p)), None)
    if partitioner is not None:  # rank 0 of the data-parallel group writes
        rank = partitioner.rank
    else:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return _write_all(
        out,
        entries,
        _gathered(named),
        max_bytes,
        writer=rank == 0,
        progress=progress and rank == 0,
    )
