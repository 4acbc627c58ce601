"""The manifest of a universal checkpoint: what every shard file holds, checked before loading.

[Note: universal checkpoint manifest]
A checkpoint directory holds one ``zero_shards_rank{r:05d}.pt`` per rank (that rank's
:class:`~ds_zero._shards.TensorShard` values, keyed ``"<piece key>/<value>"``), ``scalars.pt``
(optimizer hyper-parameters and scalar state, loss scaler, counters: the same on every rank, so
taken from rank 0), an optional ``client_state.pt`` and ``manifest.json``::

    {"format": "ds_zero.universal/1", "world_size": 4, "stage": 2,
     "files": {"zero_shards_rank00000.pt": {"bytes": 12345, "crc32": [3141592]}, ...},
     "tensors": {"tok.weight": {"shape": [64, 32], "dtype": "torch.float32",
                                "values": ["param", "exp_avg", "exp_avg_sq"],
                                "pieces": [["zero_shards_rank00000.pt", "p0", 0, 512], ...]}},
     "aliases": {"head.weight": "tok.weight"}}

A piece ``[file, key, start, stop]`` says that elements ``[start, stop)`` of the flattened
tensor are in ``file`` under ``key/<value>`` for each of the tensor's values; the shard file's
own ``__index__`` records ``[name, start, stop]`` under each key, so a piece is bound to the
tensor range it holds. Checksums (CRC-32 per 16 MiB chunk, see [Note: checkpoint integrity])
are computed while the bytes are written (no second read) and the manifest is sealed with its
own checksum. Loading refuses the directory unless
every file is present with its recorded size and checksum (each rank hashes every N-th file,
so verification is shared) and every element of every tensor is covered by exactly one piece;
the message names the tensor, the element range and the file, because a silently truncated or
partial sharded save otherwise surfaces weeks later as a diverging run. The manifest never
mentions padding or partitions: a loader of any world size and stage asks for ranges by name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ds_zero._file_problem import file_problem
from ds_zero._integrity import ChunkedCrcWriter
from ds_zero._read_checks import dtype_of, holds_value
from ds_zero._readahead import read_ahead
from ds_zero._sealed import (
    CheckpointError,
    load_file,
    read_sealed_manifest,
    write_sealed,
)
from ds_zero._shards import ShardLookup

__all__ = [
    "FORMAT",
    "INDEX",
    "MANIFEST",
    "CheckpointError",
    "SettlingLookup",
    "ShardReader",
    "binding_problems",
    "build_manifest",
    "coverage_problems",
    "dtype_of",
    "file_problems",
    "read_manifest",
    "shard_file",
    "write_hashed",
    "write_manifest",
]

FORMAT = "ds_zero.universal/1"
MANIFEST = "manifest.json"
INDEX = "__index__"


def shard_file(rank: int) -> str:
    """The name of rank ``rank``'s shard file."""
    return f"zero_shards_rank{rank:05d}.pt"


def write_hashed(obj: Any, path: Path) -> dict[str, Any]:
    """``torch.save`` ``obj`` to ``path``, fsync it, and return its size and chunk checksums
    (computed from the bytes as they are written; see [Note: checkpoint integrity]).

    Example:
        >>> write_hashed({"w": torch.ones(3)}, Path("ckpt/.x.partial/scalars.pt"))["bytes"]
    """
    with open(path, "wb") as f:
        writer = ChunkedCrcWriter(f)
        torch.save(obj, writer)  # pyright: ignore[reportArgumentType]  (a file-like writer)
        f.flush()
        os.fsync(f.fileno())
    return writer.record()


# --- building ------------------------------------------------------------------------------------


def build_manifest(
    payloads: Sequence[Mapping[str, Any]],
    *,
    stage: int | None,
    order: Sequence[str] = (),
    aliases: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The manifest from every rank's payload (see [Note: universal checkpoint manifest]).

    Args:
        payloads: per rank ``{"file", "bytes", "crc32", "pieces": [{"name", "shape",
            "dtype", "values", "key", "start", "stop"}, ...]}``.
        stage: the ZeRO stage that saved it, None when unknown (informational: loading never needs it).
        order: parameter names in the model's order (tensors are listed in it; others follow).
        aliases: tied parameter names and the name they share storage with.

    Raises:
        CheckpointError: two ranks give one tensor different shapes or dtypes.
    """
    tensors: dict[str, dict[str, Any]] = {}
    files: dict[str, dict[str, Any]] = {}
    for payload in payloads:
        files[payload["file"]] = {"bytes": payload["bytes"], "crc32": payload["crc32"]}
        for piece in payload["pieces"]:
            entry = tensors.setdefault(
                piece["name"],
                {
                    "shape": list(piece["shape"]),
                    "dtype": piece["dtype"],
                    "values": list(piece["values"]),
                    "pieces": [],
                },
            )
            if entry["shape"] != list(piece["shape"]) or entry["dtype"] != piece["dtype"]:
                raise CheckpointError(
                    f"tensor {piece['name']!r} is {piece['dtype']} {list(piece['shape'])} in "
                    f"{payload['file']} but {entry['dtype']} {entry['shape']} elsewhere: the ranks "
                    "disagree about the model"
                )
            entry["pieces"].append([payload["file"], piece["key"], piece["start"], piece["stop"]])
    rank = {name: i for i, name in enumerate(order)}
    ordered = sorted(tensors, key=lambda n: rank.get(n, len(rank)))
    return {
        "format": FORMAT,
        "world_size": len(payloads),
        "stage": stage,
        "files": files,
        "tensors": {name: tensors[name] for name in ordered},
        "aliases": dict(aliases or {}),
    }


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of ``directory``, or a :class:`CheckpointError` saying what is there."""
    return read_sealed_manifest(
        directory / MANIFEST,
        FORMAT,
        "this ds-zero",
        f"{str(directory)!r} has no {MANIFEST}: not a ds-zero checkpoint, or a save that did "
        "not finish",
    )


def shard_destinations(
    folder: str | os.PathLike[str], layout: Any
) -> dict[str, dict[str, torch.Tensor]]:
    """``layout.shard_destinations`` of the checkpoint in ``folder`` (ds-zero's [Note: copying the
    pieces into the optimizer's buffers]); nothing where its manifest cannot be read (the load's
    verification says why)."""
    try:
        manifest = read_manifest(Path(folder))
    except CheckpointError:
        return {}
    return layout.shard_destinations(manifest)


# --- verifying -----------------------------------------------------------------------------------


def _ranges(starts_stops: Iterable[tuple[int, int]]) -> str:
    return ", ".join(f"[{a}, {b})" for a, b in starts_stops)


def coverage_problems(manifest: Mapping[str, Any]) -> list[str]:
    """Every tensor's elements not covered exactly once, each naming the tensor and files."""
    problems: list[str] = []
    files = manifest["files"]
    for name, entry in manifest["tensors"].items():
        numel = 1
        for size in entry["shape"]:
            numel *= int(size)
        pieces = sorted((p for p in entry["pieces"] if p[2] < p[3]), key=lambda p: (p[2], p[3]))
        at, last_file = 0, None
        for file, _, start, stop in pieces:
            if file not in files:
                problems.append(
                    f"tensor {name!r} elements [{start}, {stop}) are in {file}, which the "
                    "manifest does not list"
                )
            if start > at:
                after = f" (after {last_file})" if last_file else ""
                problems.append(
                    f"tensor {name!r} elements [{at}, {start}) are missing: no shard file holds "
                    f"them{after}; the save was partial"
                )
            elif start < at:
                problems.append(
                    f"tensor {name!r} elements [{start}, {min(at, stop)}) are covered twice: by "
                    f"{last_file} and {file}"
                )
            if stop > at:
                at, last_file = stop, file
        if at < numel:
            problems.append(
                f"tensor {name!r} elements [{at}, {numel}) are missing: no shard file holds them; "
                "the save was partial"
            )
        elif at > numel:
            problems.append(
                f"tensor {name!r} of shape {tuple(entry['shape'])} has pieces up to element {at} "
                f"in {last_file}: past its {numel} elements"
            )
    return problems


def _pieces_in(manifest: Mapping[str, Any], file: str) -> list[tuple[str, int, int]]:
    return [
        (name, start, stop)
        for name, entry in manifest["tensors"].items()
        for f, _, start, stop in entry["pieces"]
        if f == file and start < stop
    ]


def file_problems(
    directory: Path, manifest: Mapping[str, Any], *, rank: int = 0, world_size: int = 1
) -> list[str]:
    """Problems of the files this rank checks (every ``world_size``-th, from ``rank``): absent,
    truncated or corrupted, each naming the tensors whose elements are lost with it."""
    problems = []
    for index, (file, record) in enumerate(sorted(manifest["files"].items())):
        if index % world_size != rank:
            continue
        problem = file_problem(directory, file, record)
        if problem is None:
            continue
        lost = _pieces_in(manifest, file)
        if not lost:
            problems.append(f"{problem}: the checkpoint is incomplete")
            continue
        name, start, stop = lost[0]
        more = f" (and {len(lost) - 1} more pieces of tensors)" if len(lost) > 1 else ""
        problems.append(f"tensor {name!r} elements [{start}, {stop}) are missing{more}: {problem}")
    return problems


# --- reading -------------------------------------------------------------------------------------


class ShardReader:
    """Reads any element range of a checkpoint's tensors, touching only the bytes it needs.

    Shard files are opened lazily with ``torch.load(mmap=True)``, so a range costs the pages that
    hold it. Verify the directory first (:func:`file_problems`, :func:`coverage_problems`).

    Example:
        >>> reader = ShardReader(Path("ckpt"), read_manifest(Path("ckpt")))
        >>> reader.lookup("tok.weight", 0, 128)["exp_avg"]
    """

    def __init__(
        self,
        directory: Path,
        manifest: Mapping[str, Any],
        opened: dict[str, Mapping[str, Any]] | None = None,
        on_open: Callable[[Path, Any], None] | None = None,
        copied: Callable[[Path, str], torch.Tensor | None] | None = None,
    ) -> None:
        self.directory, self.manifest = directory, manifest
        # Files already mapped and unpickled (by :func:`binding_problems`): parsed once per load.
        self._open: dict[str, Mapping[str, Any]] = opened if opened is not None else {}
        # Told of each file the reader maps itself (a pending verification hashes what was
        # read: ds-zero's [Note: verifying what the loader read]).
        self._on_open = on_open
        # A verified copy of a file's tensor, by path and name, where a pending verification
        # copied it out while hashing (ds-zero's [Note: copying while verifying]).
        self._copied = copied

    def _file(self, file: str) -> Mapping[str, torch.Tensor]:
        if file not in self._open:
            path = self.directory / file
            self._open[file] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            if self._on_open is not None:
                self._on_open(path, self._open[file])
        return self._open[file]

    def open(self, values: Sequence[str] = ("param",)) -> dict[str, Mapping[str, Any]]:
        """Map every shard file holding a piece of ``values`` now (reading nothing else),
        so that what a load will read is known before its first lookup; returns the mapped
        files by name."""
        files = {
            file
            for entry in self.manifest["tensors"].values()
            if any(v in entry["values"] for v in values)
            for file, _, start, stop in entry["pieces"]
            if start < stop
        }
        for file in sorted(files):
            stored = self._file(file)
            read_ahead(
                t
                for key, t in stored.items()
                if isinstance(t, torch.Tensor) and holds_value(key, values)
            )
        return dict(self._open)

    def entry(self, name: str) -> Mapping[str, Any]:
        """The manifest entry of tensor ``name`` (a :class:`CheckpointError` when absent)."""
        entry = self.manifest["tensors"].get(name)
        if entry is None:
            known = list(self.manifest["tensors"])
            raise CheckpointError(
                f"tensor {name!r} is not in the checkpoint {str(self.directory)!r} (it holds "
                f"{len(known)} tensors, e.g. {known[:4]}); load it into the model it was saved from"
            )
        return entry

    def lookup(
        self, name: str, start: int, stop: int, values: Sequence[str] | None = None
    ) -> dict[str, torch.Tensor]:
        """Elements ``[start, stop)`` of tensor ``name``: each saved value (or those in
        ``values``) as a new fp32 1-D tensor, or, for a range that one piece holds whose
        values were copied out while verified, a view of that copy (see ds-zero's [Note:
        copying while verifying]; a load reads each range once). Satisfies
        :data:`~ds_zero._shards.ShardLookup`."""
        entry = self.entry(name)
        wanted = [v for v in entry["values"] if values is None or v in values]
        pieces = [p for p in entry["pieces"] if max(p[2], start) < min(p[3], stop)]
        one = len(pieces) == 1 and pieces[0][2] <= start and stop <= pieces[0][3]
        if one and self._copied is not None:  # a reader without copies looks for none
            file, key, a, _ = pieces[0]
            copies = {v: self._copy(file, f"{key}/{v}") for v in wanted}
            if all(c is not None and c.dtype == torch.float32 for c in copies.values()):
                # views of the verified copy, which nothing else reads or writes: no copy here
                return {v: c[start - a : stop - a] for v, c in copies.items() if c is not None}
        out = {v: torch.empty(stop - start, dtype=torch.float32) for v in wanted}
        covered = 0
        for file, key, a, b in pieces:
            low, high = max(a, start), min(b, stop)
            for value in wanted:
                piece = self._copy(file, f"{key}/{value}")
                if piece is None:
                    piece = self._file(file)[f"{key}/{value}"]
                out[value][low - start : high - start].copy_(piece[low - a : high - a])
            covered += high - low
        if covered != stop - start:
            raise CheckpointError(
                f"tensor {name!r} elements [{start}, {stop}): only {covered} are in the "
                "checkpoint's pieces; verify the checkpoint first"
            )
        return out

    def _copy(self, file: str, key: str) -> torch.Tensor | None:
        """The verified copy of ``file``'s tensor ``key`` (flat), or None."""
        copy = None if self._copied is None else self._copied(self.directory / file, key)
        return None if copy is None else copy.view(-1)

    def tensor(self, name: str, value: str = "param") -> torch.Tensor:
        """The whole fp32 tensor ``name`` (one value), in its saved shape."""
        entry = self.entry(name)
        numel = 1
        for size in entry["shape"]:
            numel *= int(size)
        return self.lookup(name, 0, numel, (value,))[value].view(entry["shape"])

    def close(self) -> None:
        """Drop the mapped files."""
        self._open.clear()


class SettlingLookup:
    """A shard lookup whose values may be read before the checkpoint's verdict but not used:
    the optimizer assembles what it needs into tensors of its own, calls :meth:`settle`, and
    only then writes them into its masters, state and parameters (see ds-zero's [Note:
    verification overlapped with reading]). An optimizer that knows nothing of it is settled
    before it is called.

    Example:
        >>> lookup = SettlingLookup(reader.lookup, pending_check)
        >>> values = lookup("tok.weight", 0, 128)  # read
        >>> lookup.settle()  # every rank's verdict; raises on every rank when the files differ
    """

    def __init__(self, lookup: ShardLookup, settle: Callable[[BaseException | None], None]) -> None:
        self._lookup, self._settle, self.settled = lookup, settle, False

    def __call__(self, name: str, start: int, stop: int) -> Mapping[str, torch.Tensor]:
        return self._lookup(name, start, stop)

    def settle(self, failure: BaseException | None = None) -> None:
        """Wait for the verdict (once; a collective: every rank calls it at the same point).
        ``failure``: what went wrong reading on this rank, told to every rank; it raises then."""
        if self.settled:
            if failure is not None:
                raise failure
            return
        self.settled = True
        self._settle(failure)
        if failure is not None:
            raise failure


def write_manifest(manifest: Mapping[str, Any], path: Path) -> None:
    """Write ``manifest`` sealed (see [Note: the manifest's two seals]), fsynced, through a
    rename."""
    write_sealed(manifest, path)


def binding_problems(
    directory: Path,
    manifest: Mapping[str, Any],
    files: Sequence[str],
    opened: dict[str, Mapping[str, Any]] | None = None,
) -> list[str]:
    """Pieces whose key in ``files`` holds another tensor's elements than the manifest says:
    each shard file records, under ``__index__``, the tensor name and element range of each of
    its keys, so a manifest pointing a piece at the wrong key is refused before loading.
    ``opened``: each file read (mapped, unpickled) is left there for a :class:`ShardReader` of
    the same load, so no shard file is parsed twice."""
    problems = []
    for file in files:
        if file not in manifest["files"] or not file.startswith("zero_shards_"):
            continue
        try:
            stored = load_file(directory / file, mmap=True)
            if opened is not None and isinstance(stored, Mapping):
                opened[file] = stored
            index = stored.get(INDEX)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        if index is None:
            problems.append(f"{file} has no {INDEX}: written by an older ds; save it again")
            continue
        for name, entry in manifest["tensors"].items():
            for f, key, start, stop in entry["pieces"]:
                if f == file and list(index.get(key, ())) != [name, start, stop]:
                    problems.append(
                        f"tensor {name!r} elements [{start}, {stop}) point at {file} key "
                        f"{key!r}, which holds {index.get(key)!r} [name, start, stop]: the "
                        "manifest does not match the file"
                    )
    return problems
