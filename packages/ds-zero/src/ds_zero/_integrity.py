"""Checkpoint integrity: every file of a checkpoint directory listed with its size, checksums and
the tensors it holds, and checked before any value is loaded.

[Note: checkpoint integrity]
A finished checkpoint directory holds ``ds_manifest.json``::

    {"format": "ds.checkpoint/1", "chunk": 16777216,
     "files": {"mp_rank_00_model_states.pt": {"bytes": 9043, "crc32": [2837261], "tensors": {
                   "module/tok.weight": {"offset": 1344, "nbytes": 8192, "shape": [64, 32],
                                         "dtype": "torch.float32", "crc32": 99121}, ...}},
               "zero/zero_shards_rank00000.pt": {...}, "rng_state_rank00001.pt": {...}, ...},
     "manifest_crc32": 1234}

Every file under the directory is listed (model states, optimizer shards, rng, scheduler and
client state, layer and expert files, the nested ``zero/manifest.json``), so a file that is
changed, truncated, swapped for another or added afterwards is refused. A file's checksums are
CRC-32 of consecutive 16 MiB chunks (hashed on several threads, as fast as the disk; zlib
releases the GIL), and each tensor of a ``.pt`` file is bound to its file, its name (its path in
the saved object), the byte offset of its storage in the file, its shape, dtype and the CRC-32 of
its bytes. Loading checks whole files first (cheap: one pass, shared out among the ranks); only
when a file fails are its tensors checked one by one, so the error names the tensor whose bytes
changed, or says the pickled non-tensor data (counters such as ``global_steps``, the client
state) changed. ``manifest_crc32`` seals the manifest itself: an edited manifest is refused.

Verification is collective: each rank checks a share of the files, every rank gets every rank's
problems (one ``all_gather_object``) and all raise the same :class:`CheckpointError`, so no
rank waits on one that failed.

[Note: verification overlapped with reading]
Checksumming a checkpoint costs about as much CPU as reading it, so done first it adds that to
every load. :func:`start_verification` instead starts each rank's share of the checksums on
threads (zlib releases the GIL) and returns; the loader meanwhile reads what it needs into
memory of its own (the model file unpickled, the optimizer's ranges assembled into new
tensors) and calls :meth:`PendingVerification.wait` before it writes any value into the model,
the optimizer, the engine's counters or the RNG. A reading error met before the verdict is not
raised on the spot (the other ranks would wait on this one): it is noted and told to every rank
at the wait, with the checksums' verdict, which names the damaged file. Reading a damaged file
runs no code (``weights_only``), so an early read is safe; only using its values is not.
:func:`verify_directory` is the same check done at once.

[Note: a path verifies what it uses]
A load checks exactly the bytes it reads. A ZeRO-3 load without the optimizer's states reads
only the fp32 masters (``<piece>/param``) of the shard files, a third of their bytes: hashing
the rest would cost more than the load. ``start_verification(values=("param",))`` therefore
checks, in each shard file, the masters and the bytes between the tensors (the pickle, the zip
headers and directory: ``gaps_crc32``, see [Note: verifying what the loader read]); a
manifest without ``gaps_crc32`` has the chunks holding the file's non-tensor bytes checked by
their chunk CRC-32s instead. Other files are checked whole. A ZeRO-1/2 load without the
optimizer's states rebuilds the masters from the weights and reads no ``zero/`` file:
:meth:`PendingVerification.skip` leaves them unchecked. A mismatch falls back to the
whole-file check, so the error still names the file and the tensors. Corruption in bytes such
a load never reads (Adam moments) is not its error; a full load, which reads them, refuses it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ds_zero._checksums import CHUNK, ChunkedCrcWriter, spans_crc, spare_core
from ds_zero._checksums import chunks as _chunks
from ds_zero._checksums import crc32 as _crc32
from ds_zero._checksums import crc_range as _crc_range
from ds_zero._checksums import crc_ranges as _crc_ranges
from ds_zero._checksums import threads as _threads
from ds_zero._ranks import agree, ranks_in
from ds_zero._read_checks import (
    HelpedPool,
    LoadedFile,
    batches,
    fusable,
    gap_spans,
    holds_value,
    listing,
    loaded_matches,
    tensor_crcs,
    walk,
    wanted_tensors,
)

__all__ = [
    "CHUNK",
    "DIRECTORY_MANIFEST",
    "CheckpointError",
    "ChunkedCrcWriter",
    "PendingVerification",
    "agree",
    "check_seal",
    "file_problem",
    "file_record",
    "is_complete",
    "load_file",
    "read_json",
    "seal",
    "start_verification",
    "verify_directory",
    "verify_files",
    "write_directory_manifest",
]

DIRECTORY_MANIFEST = "ds_manifest.json"
DIRECTORY_FORMAT = "ds.checkpoint/1"
_SEAL = "manifest_crc32"


class CheckpointError(ValueError):
    """A checkpoint directory that is incomplete, corrupted or does not fit the optimizer."""


# --- records --------------------------------------------------------------------------------------


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


# --- the manifest file ---------------------------------------------------------------------------


def _canonical(manifest: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k != _SEAL}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def seal(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """``manifest`` with its own CRC-32 added (an edited manifest is then refused)."""
    return {**manifest, _SEAL: _crc32(_canonical(manifest))}


def check_seal(manifest: Mapping[str, Any], path: Path) -> None:
    """Raise :class:`CheckpointError` unless ``manifest`` (read from ``path``) is sealed and
    unchanged."""
    if _SEAL not in manifest:
        raise CheckpointError(
            f"{path} has no {_SEAL}: written by an older ds or by hand, so its entries cannot be "
            "trusted; save the checkpoint again with this version"
        )
    if manifest[_SEAL] != _crc32(_canonical(manifest)):
        raise CheckpointError(
            f"{path} was changed after it was written (its {_SEAL} does not match its "
            "contents): the checkpoint cannot be trusted"
        )


def read_json(path: Path, what: str) -> dict[str, Any]:
    """The JSON object in ``path``; a :class:`CheckpointError` naming the file and what is wrong
    with it otherwise (``what`` says what the file is)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{what} {str(path)!r} does not exist") from None
    except OSError as exc:
        raise CheckpointError(f"{what} {str(path)!r} cannot be read: {exc}") from None
    if not raw:
        raise CheckpointError(f"{what} {str(path)!r} is empty (0 bytes): the write did not finish")
    try:
        loaded = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointError(
            f"{what} {str(path)!r} is not UTF-8 JSON text (byte {exc.start} of {len(raw)})"
        ) from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(
            f"{what} {str(path)!r} is not valid JSON ({exc.msg} at line {exc.lineno} column "
            f"{exc.colno}, {len(raw)} bytes): truncated or overwritten"
        ) from None
    if not isinstance(loaded, dict):
        raise CheckpointError(
            f"{what} {str(path)!r} holds a {type(loaded).__name__}, not an object"
        )
    return loaded


def load_file(path: Path, *, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU; a :class:`CheckpointError` naming the
    file and the reason when it is absent, truncated or not a checkpoint file."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {str(path)!r} does not exist")
    try:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except Exception as exc:  # torch raises OSError, RuntimeError or UnpicklingError
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"checkpoint file {str(path)!r} ({path.stat().st_size} bytes) cannot be read: it is "
            f"truncated, corrupted or not a torch.save file ({type(exc).__name__}: {reason})"
        ) from None


def is_complete(directory: Path, manifest_name: str = DIRECTORY_MANIFEST) -> bool:
    """Whether ``directory`` holds a finished save: its manifest present, whole and sealed."""
    try:
        check_seal(read_json(directory / manifest_name, "manifest"), directory / manifest_name)
    except CheckpointError:
        return False
    return True


# --- verifying -----------------------------------------------------------------------------------


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
    it matches): absent, truncated, or corrupted, naming the tensors whose bytes changed.
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


def _is_shard_file(name: str) -> bool:
    """Whether ``name`` is a ds-zero shard file (tensors keyed ``<piece>/<value>``)."""
    parts = name.split("/")  # manifest names are POSIX paths
    return (
        len(parts) == 2 and parts[0].startswith("zero") and parts[1].startswith("zero_shards_rank")
    )


def _read_parts(
    record: Mapping[str, Any], size: int, chunk: int, values: Collection[str]
) -> tuple[list[int], list[str]]:
    """What a load reading only ``values`` of a shard file uses (see [Note: a path verifies
    what it uses]): the chunks holding the file's non-tensor bytes (the pickle and the zip
    directory, before the first tensor and after the last), and the tensors of ``values``
    outside those chunks, each checked by its own CRC-32."""
    entries = record.get("tensors") or {}
    if not entries:
        return list(range(len(_chunks(size, chunk)))), []
    first = min(e["offset"] for e in entries.values())
    last = max(e["offset"] + e["nbytes"] for e in entries.values())
    picked = set(range(0, (first + chunk - 1) // chunk if first else 1))
    picked |= set(range(last // chunk, (size + chunk - 1) // chunk))
    covered = {(i * chunk, min(size, (i + 1) * chunk)) for i in picked}
    tensors = [
        n
        for n, e in entries.items()
        if holds_value(n, values)
        and not any(a <= e["offset"] and e["offset"] + e["nbytes"] <= b for a, b in covered)
    ]
    return sorted(picked), tensors


def _partial_problem(
    directory: Path,
    name: str,
    record: Mapping[str, Any],
    crcs: Sequence[int],
    picked: Sequence[int],
    tensors: Sequence[str],
) -> str | None:
    """None when the chunks ``picked`` and the ``tensors`` of file ``name`` match the manifest;
    a description otherwise."""
    if (directory / name).stat().st_size != record["bytes"]:
        return f"{name} truncated"
    expected = [record["crc32"][i] for i in picked]
    expected += [record["tensors"][n]["crc32"] for n in tensors]
    return None if list(crcs) == expected else f"{name} corrupted"


def _share(files: Mapping[str, Mapping[str, Any]], rank: int, world: int) -> list[str]:
    """This rank's files to check: the biggest first, each to the least-loaded rank."""
    load = [0] * world
    mine = []
    for name in sorted(files, key=lambda n: (-int(files[n]["bytes"]), n)):
        owner = min(range(world), key=lambda r: (load[r], r))
        load[owner] += int(files[name]["bytes"]) + 1
        if owner == rank:
            mine.append(name)
    return mine


def verify_files(
    directory: Path, files: Mapping[str, Mapping[str, Any]], *, rank: int = 0, world_size: int = 1
) -> list[str]:
    """Problems of this rank's share of ``files`` (each rank checks about 1/world of the bytes)."""
    problems = []
    for name in _share(files, rank, world_size):
        try:
            problem = file_problem(directory, name, files[name])
        except OSError as exc:
            problem = f"{name} cannot be read: {exc}"
        if problem is not None:
            problems.append(problem)
    return problems


def _listing(directory: Path) -> list[str]:
    return listing(directory, DIRECTORY_MANIFEST)


def write_directory_manifest(directory: Path, *, group: Any = None) -> None:
    """Record every file under ``directory`` in its ``ds_manifest.json`` (each rank checksums a
    share; global rank 0 of ``group`` writes the manifest, fsynced, through a rename). Every rank
    of ``group`` must call it, after every file is written."""
    rank, world = ranks_in(group)
    names = _listing(directory)
    sizes = {n: {"bytes": (directory / n).stat().st_size} for n in names}
    mine = {n: file_record(directory / n) for n in _share(sizes, rank, world)}
    files: dict[str, Any] = {}
    if world > 1:
        out: list[Any] = [None] * world
        dist.all_gather_object(out, mine, group=group)
        for part in out:
            files.update(part)
    else:
        files = mine
    if rank == 0:
        manifest = seal(
            {"format": DIRECTORY_FORMAT, "chunk": CHUNK, "files": dict(sorted(files.items()))}
        )
        write_json_atomic(manifest, directory / DIRECTORY_MANIFEST)


def write_json_atomic(obj: Any, path: Path) -> None:
    """Write ``obj`` as JSON through a fsynced temporary file and a rename."""
    temp = path.with_name(f".{path.name}.tmp")
    with open(temp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)


def _unusable(path: Path, problems: Sequence[str]) -> str:
    shown = list(problems[:8])
    more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    return f"checkpoint {str(path)!r} cannot be loaded:\n  " + "\n  ".join(shown) + more


def read_sealed_manifest(
    path: Path, expected_format: str, reader: str, missing: str
) -> dict[str, Any]:
    """A sealed manifest file: ``missing`` as the error when absent, then its format (``reader``
    names what reads it) and its seal checked (a :class:`CheckpointError` otherwise)."""
    if not path.is_file():
        raise CheckpointError(missing)
    manifest = read_json(path, "checkpoint manifest")
    if manifest.get("format") != expected_format:
        raise CheckpointError(
            f"{path} has format {manifest.get('format')!r}; {reader} reads {expected_format!r}"
        )
    check_seal(manifest, path)
    return manifest


def read_directory_manifest(directory: Path) -> dict[str, Any]:
    """The sealed ``ds_manifest.json`` of ``directory`` (a :class:`CheckpointError` naming what
    is wrong otherwise)."""
    return read_sealed_manifest(
        directory / DIRECTORY_MANIFEST,
        DIRECTORY_FORMAT,
        "this ds",
        f"checkpoint {str(directory)!r} has no {DIRECTORY_MANIFEST}: the save did not finish, "
        "or an older ds wrote it; nothing in it can be verified, so it is not loaded",
    )


class PendingVerification:
    """A checkpoint directory's checksums, running on threads while the loader reads (see
    [Note: verification overlapped with reading]).

    Made by :func:`start_verification`. :meth:`wait` is the verdict, collective over the group
    (every rank calls it at the same point; all get the same answer); nothing read from the
    directory may be used before the :meth:`wait` that covers its file returned.
    ``overlap``: a loader runs beside the checksums, so one core is left to it, and the shard
    files it may hand over through :meth:`hash_loaded` (and, where no core is spare, the other
    files named in ``loaded``) are not hashed apart until the verdict (see [Note: verifying
    what the loader read]).
    """

    def __init__(
        self,
        directory: Path,
        group: Any,
        values: Collection[str] | None = None,
        overlap: bool = True,
        loaded: Collection[str] = (),
    ) -> None:
        self.directory, self.group, self.values = directory, group, values
        self.rank, self.world = ranks_in(group)
        self.manifest: dict[str, Any] = {}
        self._noted: list[str] = []
        self._jobs: dict[str, list[Future[int]] | None] = {}
        self._partial: dict[str, tuple[list[int], list[str]]] = {}
        # Files of this rank's share left for the loader (hashed apart at the verdict if it
        # never hands them over), and those it handed over: per file, the loaded tensors'
        # names, their dtypes and shapes, their CRC-32 jobs and the gaps' CRC-32 job.
        self._deferred: list[str] = []
        self._loaded: dict[str, LoadedFile] = {}
        self._verdict: dict[str, Any] | None = None
        self._pool: HelpedPool | None = None
        try:
            self.manifest = read_directory_manifest(directory)
        except CheckpointError as exc:
            self._noted.append(str(exc))
            return
        files = self.manifest["files"]
        # The smallest files first: a loader reads the model states before the big optimizer
        # shards, so the checksums read its pages with it, then run ahead of it (read-ahead
        # from a cold disk). One core is left to the loader (``overlap``). The shard files,
        # which a loader maps and reads in part, wait for it to hand them over.
        # The loader's other files (``loaded``) are hashed from its tensors after its read
        # (one pass, on its critical path) only where no core is free to hash them beside
        # the read (a second pass over the page cache, on a core that would otherwise idle).
        mine = sorted(_share(files, self.rank, self.world), key=lambda n: int(files[n]["bytes"]))
        threads = _threads(reserve=1 if overlap else 0)
        self._pool = HelpedPool(threads)
        after_read = set(loaded) if not spare_core() else set()
        for name in mine:
            handed = _is_shard_file(name) or name in after_read
            if overlap and handed and fusable(files[name]):
                self._deferred.append(name)
            else:
                self._jobs[name] = self._submit(name, files[name])

    def skip(self, folder: str) -> None:
        """Leave the files under ``folder`` (relative to the directory, ending in ``/``)
        unchecked: the load reads none of them (a ZeRO-1/2 load without the optimizer's states
        rebuilds the fp32 masters from the weights; see [Note: a path verifies what it uses])."""
        for name in [n for n in self._jobs if n.startswith(folder)]:
            for job in self._jobs.pop(name) or ():
                job.cancel()
        self._deferred = [n for n in self._deferred if not n.startswith(folder)]

    def hash_loaded(self, path: str | os.PathLike[str], obj: Any) -> None:
        """Check file ``path`` of the directory from what the loader read of it: ``obj``, the
        object ``torch.load`` returned (mapped or not), whose tensors are hashed in place on
        the checksum threads (see [Note: verifying what the loader read]). Call it before the
        :meth:`wait` whose verdict covers the values used; nothing happens for a file already
        being hashed, one whose manifest lacks the tensors' bindings, or after the verdict."""
        if self._verdict is not None or self._pool is None:
            return
        try:
            name = Path(path).relative_to(self.directory).as_posix()
        except ValueError:
            return
        record = self.manifest.get("files", {}).get(name)
        if record is None or not fusable(record) or name in self._jobs or name in self._loaded:
            return
        wanted = set(wanted_tensors(record, _is_shard_file(name), self.values))
        found: list[tuple[str, torch.Tensor]] = []
        walk(obj, "", found, wanted)
        tensors = [(n, t) for n, t in found if n in wanted and t.device.type == "cpu"]
        meta = {n: (str(t.dtype), list(t.shape)) for n, t in tensors}
        jobs, order = [], []
        for batch in batches(tensors):
            order += [n for n, _ in batch]
            jobs.append(self._pool.submit(tensor_crcs, [t for _, t in batch]))
        spans = gap_spans(record["tensors"], int(record["bytes"]))
        gaps = self._pool.submit(spans_crc, self.directory / name, spans)
        self._loaded[name] = (meta, jobs, order, gaps)
        if name in self._deferred:
            self._deferred.remove(name)

    def _result(self, job: Future[Any]) -> Any:
        assert self._pool is not None
        return self._pool.result(job)

    def _loaded_problem(self, name: str, record: Mapping[str, Any]) -> str | None:
        """None when what the loader read of ``name`` (and the gaps) matches the manifest;
        otherwise the chunk check's description, which names the file and the tensors."""
        meta, jobs, order, gaps = self._loaded.pop(name)
        crcs = (crc for job in jobs for crc in self._result(job))
        loaded = {n: (*meta[n], crc) for n, crc in zip(order, crcs)}
        try:
            size = (self.directory / name).stat().st_size
            same = loaded_matches(
                record,
                wanted_tensors(record, _is_shard_file(name), self.values),
                loaded,
                size,
                self._result(gaps),
            )
        except (OSError, ValueError):
            same = False
        if same:
            return None
        problem = file_problem(self.directory, name, record)
        return problem or f"{name} corrupted (what was read differs from the manifest)"

    def _submit(self, name: str, record: Mapping[str, Any]) -> list[Future[int]] | None:
        path = self.directory / name
        try:
            size = path.stat().st_size
        except OSError:
            return None  # absent or unreadable: file_problem says which at wait()
        if "crc32" not in record or size != record["bytes"]:
            return None
        assert self._pool is not None
        chunk = int(self.manifest.get("chunk", CHUNK))
        spans = _chunks(size, chunk)
        if self.values is not None and _is_shard_file(name):
            picked, tensors = _read_parts(record, size, chunk, self.values)
            self._partial[name] = (picked, tensors)
            spans = [spans[i] for i in picked]
            entries = record["tensors"]
            spans += [(entries[n]["offset"], entries[n]["nbytes"]) for n in tensors]
        return [self._pool.submit(_crc_range, path, a, n) for a, n in spans]

    def note(self, problem: str) -> None:
        """Add a problem the loader met while reading (told to every rank at the next wait)."""
        self._noted.append(problem)

    def _problems(self) -> list[str]:
        problems, self._noted = self._noted, []
        files = self.manifest.get("files", {})
        for name in self._deferred:  # never handed over by the loader: hashed apart now
            self._jobs[name] = self._submit(name, files[name])
        self._deferred = []
        if self._pool is not None:  # the loader's core hashes too while it waits
            jobs = [job for jobs in self._jobs.values() for job in jobs or ()]
            jobs += [job for j in self._loaded.values() for job in (*j[1], j[3])]
            self._pool.help(jobs)
        for name in list(self._loaded):
            try:
                problem = self._loaded_problem(name, files[name])
            except OSError as exc:
                problem = f"{name} cannot be read: {exc}"
            if problem is not None:
                problems.append(problem)
        for name, jobs in self._jobs.items():
            try:
                crcs = [self._result(job) for job in jobs] if jobs is not None else None
                if crcs is not None and name in self._partial:
                    problem = _partial_problem(
                        self.directory, name, files[name], crcs, *self._partial[name]
                    )
                    if problem is None:
                        continue
                    crcs = None  # a mismatch: the whole file is checked, to name the tensors
                problem = file_problem(self.directory, name, files[name], crcs)
            except OSError as exc:
                problem = f"{name} cannot be read: {exc}"
            if problem is not None:
                problems.append(problem)
        if self.manifest and self.rank == 0:
            extra = [n for n in _listing(self.directory) if n not in files]
            problems += [
                f"{n} is not in {DIRECTORY_MANIFEST} (added after the save)" for n in extra
            ]
        return problems

    def wait(self, problems: Sequence[str] = ()) -> dict[str, Any]:
        """Every rank's verdict on every file, plus ``problems`` the caller found while reading
        (a collective; the first call decides and later calls return its manifest).

        Returns:
            The directory manifest.

        Raises:
            CheckpointError: on every rank, naming each file (and tensor) that is absent,
                truncated, corrupted or not in the manifest.
        """
        if self._verdict is not None:  # decided: a later problem is this rank's own
            if problems:
                raise CheckpointError(_unusable(self.directory, list(problems)))
            return self._verdict
        mine = self._problems() + list(problems)
        self._jobs = {}
        found = list(dict.fromkeys(agree(mine, self.group)))
        self.close()
        if found:
            if len(found) == 1 and found[0].startswith(("checkpoint ", str(self.directory))):
                raise CheckpointError(found[0])
            raise CheckpointError(_unusable(self.directory, found))
        self._verdict = self.manifest
        return self.manifest

    def close(self) -> None:
        """Stop the checksum threads (the verdict is no longer wanted)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self._loaded.clear()  # it holds the loader's tensors

    def __enter__(self) -> PendingVerification:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_verification(
    directory: str | os.PathLike[str],
    *,
    group: Any = None,
    values: Collection[str] | None = None,
    loaded: Collection[str] = (),
) -> PendingVerification:
    """Start checking a checkpoint directory against its ``ds_manifest.json`` on threads and
    return at once, so the checksums overlap the loader's reads (see [Note: verification
    overlapped with reading]). Each rank hashes a share of the files. Every rank must call
    it, and then :meth:`~PendingVerification.wait` at the same points. ``values``: the load
    reads only these values (e.g. ``("param",)``, the fp32 masters) of the ZeRO shard files, so
    only those bytes of them (and their non-tensor bytes) are checked (see [Note: a path
    verifies what it uses]); None checks every byte of every file. A loader that maps a ZeRO
    shard file hands it to :meth:`~PendingVerification.hash_loaded`, which checks it from the
    mapped tensors (see [Note: verifying what the loader read]); files the load turns out not
    to read are dropped with :meth:`~PendingVerification.skip`. ``loaded``: the other files
    (names relative to the directory, such as the model states file) the caller reads before
    the verdict and hands to :meth:`~PendingVerification.hash_loaded`. Where this process has
    a core to spare beside the loader's, they are hashed beside the read from the start, which
    hides the checksum behind the read; where it has none, they are hashed from the loader's
    tensors once read, instead of read a second time by a thread competing with the loader
    for its core (and apart, at the verdict, if never handed over).

    Example:
        >>> with start_verification(path) as pending:
        ...     state = torch.load(path / "model.pt", mmap=True)  # read, not used yet
        ...     pending.wait()  # every rank's verdict
        ...     model.load_state_dict(state)
    """
    return PendingVerification(Path(directory), group, values, loaded=loaded)


def verify_directory(directory: str | os.PathLike[str], *, group: Any = None) -> dict[str, Any]:
    """Check every file of a checkpoint directory against its ``ds_manifest.json`` before
    anything is loaded (see [Note: checkpoint integrity]). Collective over ``group`` (every rank
    must call it; all get the same verdict).

    Returns:
        The manifest.

    Raises:
        CheckpointError: naming each file (and tensor) that is absent, truncated, corrupted or
            not in the manifest, on every rank.

    Example:
        >>> verify_directory("ckpts/global_step100")["files"].keys()
    """
    with PendingVerification(Path(directory), group, overlap=False) as pending:
        return pending.wait()  # nothing runs beside the checksums: every core hashes
