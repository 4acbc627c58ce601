"""What is wrong with a checkpoint file against its manifest record, in words that name the file
and the tensors whose bytes changed (see [Note: checkpoint integrity] in ``_integrity.py``)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ds_zero._checksums import chunks as _chunks
from ds_zero._checksums import crc32 as _crc32
from ds_zero._checksums import crc_ranges as _crc_ranges

__all__ = ["file_problem", "small_file_problem"]


def _damaged_tensors(path: Path, record: Mapping[str, Any], size: int) -> list[str]:
    """The tensors of a failed file whose bytes are gone or differ."""
    entries = record.get("tensors", {})
    whole = {n: e for n, e in entries.items() if e["offset"] + e["nbytes"] <= size}
    crcs = _crc_ranges([(path, e["offset"], e["nbytes"]) for e in whole.values()])
    damaged = [n for (n, e), crc in zip(whole.items(), crcs) if crc != e["crc32"]]
    return damaged + [n for n in entries if n not in whole]


def _describe(names: Sequence[str], entries: Mapping[str, Any]) -> str:
    shown = [
        f"{n!r} ({entries[n]['dtype']} {entries[n]['shape']} at byte {entries[n]['offset']})"
        for n in names[:3]
    ]
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(shown) + more


def file_problem(
    directory: Path, name: str, record: Mapping[str, Any], crcs: Sequence[int] | None = None
) -> str | None:
    """What is wrong with file ``name`` of ``directory`` against its manifest record (None when
    it matches): absent, truncated, grown or corrupted, naming the tensors whose bytes changed.
    ``crcs``: the file's chunk checksums when the caller computed them already."""
    path = directory / name
    if not path.is_file():
        return f"{name} absent"
    size = path.stat().st_size
    if "sha256" in record:  # manifests of earlier releases
        import hashlib

        if (
            size == record["bytes"]
            and hashlib.sha256(path.read_bytes()).hexdigest() == record["sha256"]
        ):
            return None
    elif size == record["bytes"]:
        if crcs is None:
            crcs = _crc_ranges([(path, a, n) for a, n in _chunks(size)])
        if list(crcs) == list(record["crc32"]):
            return None
    if size > record["bytes"]:
        return f"{name} grew after the save ({size} bytes, {record['bytes']} when written)"
    entries = record.get("tensors", {})
    damaged = _damaged_tensors(path, record, size)
    if size != record["bytes"]:
        where = f"; tensors lost: {_describe(damaged, entries)}" if damaged else ""
        return f"{name} truncated ({size} of {record['bytes']} bytes){where}"
    if damaged:
        return f"{name} corrupted: the bytes of tensor {_describe(damaged, entries)} changed"
    if "tensors" not in record:
        return f"{name} corrupted (its checksum differs from the manifest's)"
    what = "its non-tensor data (pickled counters such as global_steps, client state)"
    return f"{name} corrupted (its checksum differs from the manifest's; {what} changed)"


def small_file_problem(
    directory: Path, name: str, record: Mapping[str, Any], chunk: int
) -> str | None:
    """None when file ``name`` of ``directory`` (small: read in one system call, on the calling
    thread) matches its record, hashed in ``chunk``-byte chunks; :func:`file_problem`'s
    description otherwise."""
    expected = int(record["bytes"])
    try:
        fd = os.open(directory / name, os.O_RDONLY)
        try:
            data = os.read(fd, expected + 1)  # a longer file reads longer
        finally:
            os.close(fd)
    except OSError:
        data = b""
        expected = -1  # absent or unreadable: file_problem says which
    if "crc32" in record and len(data) == expected:
        with memoryview(data) as view:
            crcs = [_crc32(view[a : a + n]) for a, n in _chunks(expected, chunk)]
        if crcs == record["crc32"]:
            return None
    try:
        return file_problem(directory, name, record)
    except OSError as exc:
        return f"{name} cannot be read: {exc}"
