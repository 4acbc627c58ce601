"""What a checkpoint manifest records of one file: its size, the CRC-32 of each chunk, and for
a ``torch.save`` file each tensor's binding (name, byte offset, size, shape, dtype, CRC-32) and
the CRC-32 of the bytes between the tensors (see [Note: checkpoint integrity] in
``_integrity.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ds_zero._checksums import chunks as _chunks
from ds_zero._checksums import crc_ranges as _crc_ranges
from ds_zero._checksums import spans_crc
from ds_zero._read_checks import gap_spans, walk

__all__ = ["file_record"]


def _tensor_index(path: Path) -> dict[str, dict[str, Any]]:
    """Each tensor of a ``torch.save`` file: its path in the saved object, the byte offset and
    size of its storage in the file, shape, dtype and the CRC-32 of the storage's bytes (see
    [Note: checkpoint integrity]). Empty for files that are not a weights-only zip archive."""
    try:
        obj = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        reader: Any = torch._C.PyTorchFileReader(str(path))  # get_record_offset: not in stubs
        offsets = [
            reader.get_record_offset(r) for r in reader.get_all_records() if "data/" in r[:8]
        ]
    except Exception:  # not a zip-format torch file: the whole-file checksums still cover it
        return {}
    found: list[tuple[str, torch.Tensor]] = []
    walk(obj, "", found)
    stored = [(n, t) for n, t in found if t.untyped_storage().nbytes() > 0]
    if not stored or not offsets:
        return {}
    base = min(t.untyped_storage().data_ptr() for _, t in stored) - min(offsets)
    index = {}
    for name, t in stored:
        storage = t.untyped_storage()
        start, nbytes = storage.data_ptr() - base, storage.nbytes()
        if t.is_contiguous():  # the tensor's own bytes (views of one flat buffer share storage)
            start += t.storage_offset() * t.element_size()
            nbytes = t.numel() * t.element_size()
        index[name] = {
            "offset": start,
            "nbytes": nbytes,
            "shape": list(t.shape),
            "dtype": str(t.dtype),
        }
    jobs = [(path, e["offset"], e["nbytes"]) for e in index.values()]
    for entry, crc in zip(index.values(), _crc_ranges(jobs)):
        entry["crc32"] = crc
    return index


def file_record(path: Path, *, tensors: bool = True) -> dict[str, Any]:
    """``{"bytes", "crc32": [per chunk], "tensors": {...}}`` of the file at ``path``."""
    size = path.stat().st_size
    record: dict[str, Any] = {
        "bytes": size,
        "crc32": _crc_ranges([(path, a, n) for a, n in _chunks(size)]),
    }
    if tensors and path.suffix == ".pt":
        record["tensors"] = _tensor_index(path)
        if record["tensors"]:  # the bytes between them (see [Note: verifying what the loader read])
            record["gaps_crc32"] = spans_crc(path, gap_spans(record["tensors"], size))
    return record
