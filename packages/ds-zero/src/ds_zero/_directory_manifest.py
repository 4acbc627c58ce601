"""The file that makes a checkpoint directory complete: ``ds_manifest.json``, every file's record
written by the ranks together (see [Note: checkpoint integrity] in ``_integrity.py``)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ds_zero._checksums import CHUNK
from ds_zero._file_problem import file_problem
from ds_zero._file_record import file_record
from ds_zero._ranks import ranks_in
from ds_zero._read_checks import listing
from ds_zero._sealed import write_sealed

__all__ = [
    "DIRECTORY_FORMAT",
    "DIRECTORY_MANIFEST",
    "share",
    "verify_files",
    "write_directory_manifest",
]

DIRECTORY_MANIFEST = "ds_manifest.json"
DIRECTORY_FORMAT = "ds.checkpoint/1"
# Rank r's shard file of an engine without model parallelism (whose ``zero_mp<m>/`` files are
# each read by the rank of data-parallel rank r in slice m: a rank this cannot tell).
_SHARD_FILE = re.compile(r"zero/zero_shards_rank(\d+)\.pt")


def share(files: Mapping[str, Mapping[str, Any]], rank: int, world: int) -> list[str]:
    """This rank's files to check: rank r's ZeRO shard file (``zero/zero_shards_rank<r>.pt``)
    to rank r, which reads it when loading on the world size that saved it (and copies it as
    it hashes it, see ds-zero's [Note: reading the copies after the verdict]); then the others,
    the biggest first, each to the least-loaded rank."""
    order = sorted(files, key=lambda n: (-int(files[n]["bytes"]), n))
    load = [0] * world
    owners = {}
    for name in order:
        match = _SHARD_FILE.fullmatch(name)
        if match is not None and int(match.group(1)) < world:
            owners[name] = int(match.group(1))
            load[owners[name]] += int(files[name]["bytes"]) + 1
    for name in order:
        if name not in owners:
            owners[name] = min(range(world), key=lambda r: (load[r], r))
            load[owners[name]] += int(files[name]["bytes"]) + 1
    return [name for name in order if owners[name] == rank]


def verify_files(
    directory: Path, files: Mapping[str, Mapping[str, Any]], *, rank: int = 0, world_size: int = 1
) -> list[str]:
    """Problems of this rank's share of ``files`` (each rank checks about 1/world of the bytes)."""
    problems = []
    for name in share(files, rank, world_size):
        try:
            problem = file_problem(directory, name, files[name])
        except OSError as exc:
            problem = f"{name} cannot be read: {exc}"
        if problem is not None:
            problems.append(problem)
    return problems


def write_directory_manifest(directory: Path, *, group: Any = None) -> None:
    """Record every file under ``directory`` in its ``ds_manifest.json`` (each rank checksums a
    share; global rank 0 of ``group`` writes the manifest, fsynced, through a rename). Every rank
    of ``group`` must call it, after every file is written."""
    rank, world = ranks_in(group)
    names = listing(directory, DIRECTORY_MANIFEST)
    sizes = {n: {"bytes": (directory / n).stat().st_size} for n in names}
    mine = {n: file_record(directory / n) for n in share(sizes, rank, world)}
    files: dict[str, Any] = {}
    if world > 1:
        out: list[Any] = [None] * world
        dist.all_gather_object(out, mine, group=group)
        for part in out:
            files.update(part)
    else:
        files = mine
    if rank == 0:
        manifest = {
            "format": DIRECTORY_FORMAT,
            "chunk": CHUNK,
            "files": dict(sorted(files.items())),
        }
        write_sealed(manifest, directory / DIRECTORY_MANIFEST)
