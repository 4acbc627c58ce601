"""Checksums of the bytes a loader read, taken from the loader's own tensors: the second half of a
checkpoint's verification, the one that costs no second read.

[Note: verifying what the loader read]
Hashing a checkpoint file apart from the loader reads every byte twice: once into the checksum,
once into the loader (and, from a cold disk, the two readers compete for it). A ``.pt`` file's
record in ``ds_manifest.json`` holds, besides its chunk CRC-32s, every tensor's CRC-32 (bound to
its name, shape and dtype) and ``gaps_crc32``: the CRC-32 of every byte outside the tensors (the
pickle, the zip headers and directory, the alignment padding), in file order. Tensors and gaps
together cover every byte of the file. So a file the loader has opened is checked from what the
loader holds: each tensor's bytes are hashed straight from the loader's tensor (its own
allocation after a plain ``torch.load``, or its mapping of the page cache after
``mmap=True``, whose pages the loader's copies then find mapped and cached), and only the gaps,
a few KiB of headers, are read from the file. A load reading only some values of a ZeRO shard
file (the fp32 masters) checks those tensors and the gaps (see [Note: a path verifies what it
uses]). The verdict is the same as the chunk check's (every byte the load uses, bound to its
name), and a mismatch falls back to the chunk check, whose error names the file and tensor.
Manifests written before ``gaps_crc32`` are checked by chunks, as before.
"""

from __future__ import annotations

import copy
import ctypes
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any, TypeVar

import torch

from ds_zero._checksums import FileCopy, MappedFile, chunks, spans_crc
from ds_zero._checksums import crc32 as _crc32
from ds_zero._sealed import CheckpointError
from ds_zero._workers import Workers

__all__ = [
    "HelpedPool",
    "LoadedFile",
    "ahead_jobs",
    "batches",
    "dtype_of",
    "fusable",
    "gap_spans",
    "holds_value",
    "listing",
    "loaded_matches",
    "map_tensors",
    "partial_problem",
    "read_parts",
    "runs",
    "shared_copy",
    "spans_crc",
    "tensor_crcs",
    "walk",
    "wanted_tensors",
]

# The checksum threads of this process, by (process id, thread count); see HelpedPool.
_POOLS: dict[tuple[int, int], Workers] = {}

_Item = TypeVar("_Item")
_BATCH = 4 << 20  # bytes of tensors hashed per job (small: the waiting loader takes some)

# What a pending check holds of a file the loader handed over: each tensor's dtype and shape,
# the jobs hashing them (each a list of CRC-32s), the tensors' names in the jobs' order, and
# the job hashing the gaps.
LoadedFile = tuple[
    dict[str, tuple[str, list[int]]], list["Future[list[int]]"], list[str], "Future[int]"
]


def walk(
    obj: Any,
    prefix: str,
    out: list[tuple[str, torch.Tensor]],
    only: Collection[str] | None = None,
) -> None:
    """Every tensor of a loaded object with its path (``module/tok.weight``, ``p0/param``).
    ``only``: paths wanted; the top-level entries of a mapping holding none of them are not
    walked (a shard file's ``__index__``, its Adam moments when only the masters are read)."""
    if isinstance(obj, torch.Tensor):
        out.append((prefix or "<root>", obj))
    elif isinstance(obj, (dict, Mapping)):  # a dict's check first: Mapping's is slow
        heads = None if only is None else {_head(n) for n in only}
        for key, value in obj.items():
            if heads is None or _may_hold(str(key), heads):
                walk(value, _key_path(prefix, key), out)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            if not isinstance(value, _LEAVES):
                walk(value, _item_path(prefix, i), out)


_LEAVES = (str, bytes, int, float, bool, type(None))


def _key_path(prefix: str, key: object) -> str:
    """The path of a mapping's entry ``key`` under ``prefix`` (as :func:`walk` names it)."""
    return f"{prefix}/{key}" if prefix else str(key)


def _item_path(prefix: str, index: int) -> str:
    """The path of a list's or tuple's item ``index`` under ``prefix`` (as :func:`walk` names
    it)."""
    return f"{prefix}[{index}]"


def map_tensors(obj: Any, fn: Callable[[str, torch.Tensor], torch.Tensor], prefix: str = "") -> Any:
    """``obj`` with each tensor ``t`` at path ``p`` (as :func:`walk` names it) replaced by
    ``fn(p, t)``: dicts, lists and tuples holding one are rebuilt (a dict's type and attributes,
    such as a state dict's ``_metadata``, kept), everything else is returned as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(prefix or "<root>", obj)
    if isinstance(obj, dict):
        changed = {}
        for key, value in obj.items():
            new = map_tensors(value, fn, _key_path(prefix, key))
            if new is not value:
                changed[key] = new
        if not changed:
            return obj
        rebuilt = copy.copy(obj)
        rebuilt.update(changed)
        return rebuilt
    if isinstance(obj, (list, tuple)):
        items = [
            v if isinstance(v, _LEAVES) else map_tensors(v, fn, _item_path(prefix, i))
            for i, v in enumerate(obj)
        ]
        if all(new is old for new, old in zip(items, obj)):
            return obj
        return items if isinstance(obj, list) else tuple(items)
    return obj


def _may_hold(key: str, heads: Collection[str]) -> bool:
    """Whether the top-level entry ``key`` may hold a path of ``heads`` (a key with ``/`` or
    ``[`` in it is always walked: its paths' heads are cut short)."""
    return key in heads or "/" in key or "[" in key


def _head(path: str) -> str:
    """The top-level key of a tensor path made by :func:`walk` (``p0`` of ``p0/param``)."""
    return path.split("/", 1)[0].split("[", 1)[0]


def tensor_span(t: torch.Tensor) -> tuple[int, int]:
    """``(address, bytes)`` of what a manifest entry hashes: a contiguous tensor's own bytes,
    else its whole storage (as ``_tensor_index`` records them)."""
    storage = t.untyped_storage()
    if t.is_contiguous():
        size = t.element_size()
        return storage.data_ptr() + int(t.storage_offset()) * size, t.numel() * size
    return storage.data_ptr(), storage.nbytes()


def _tensor_crc(t: torch.Tensor) -> int:
    address, nbytes = tensor_span(t)
    if nbytes <= 0:
        return 0
    return _crc32(memoryview((ctypes.c_char * nbytes).from_address(address)))


def tensor_crcs(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The CRC-32 of each CPU tensor's bytes (see :func:`tensor_span`), read in place."""
    return [_tensor_crc(t) for t in tensors]


def runs(
    items: Sequence[_Item], nbytes: Callable[[_Item], int], at_least: int = _BATCH
) -> list[list[_Item]]:
    """``items`` in consecutive runs of ``at_least`` bytes (``nbytes`` of each; by default 4
    MiB) or a little more: one hashing job each (few jobs for several threads, small enough
    that a waiting loader takes some)."""
    out: list[list[_Item]] = [[]]
    size = 0
    for item in items:
        if size >= at_least:
            out.append([])
            size = 0
        out[-1].append(item)
        size += nbytes(item)
    return [b for b in out if b]


# [Note: jobs hashing ahead]
# A file hashed ahead of the loader (ds-zero's [Note: hashing ahead of the loader]) is split
# into one job a thread, each one native call that takes the GIL back only at its end (see
# [Note: which CRC-32 runs]). The end of each job takes the GIL from a loader still
# unpickling, so jobs are few:
# - A second job a thread (so that a loader waiting for the verdict could take one over) cost
#   the unpickling 0.6-1.4 ms more on a 10M-parameter ZeRO-3 weights-only load (about 30 ms),
#   and the jobs end before the loader waits anyway.
# - No job is smaller than _AHEAD_JOB, about 4 ms of hashing at 12 GB/s, which ends before the
#   loader has read the model file and unpickled the shard's index. 40 MB of masters is then
#   one job, not eight jobs and eight hand-overs of the GIL on an 8-thread host. With the
#   read-ahead skipped for pages already in memory ([Note: read-ahead of mapped shards]), that
#   load's verification overhead went from +7.1% to +4.6% on an idle 16-core host (three
#   processes each; the two changes were not measured apart there).
# A file copied out as it is hashed (ds-zero's [Note: copying while verifying]) costs about
# four times the hashing a byte, and the loader, left nothing to copy itself, waits for it at
# the verdict. It was split into jobs of 8 MiB, so that the waiting loader could take those no
# thread had started; but each job's end took the GIL back from the loader, and the Python
# between two jobs waited for it too: on the 2-core VM the first 8 MB job of a 40 MB model file
# ran 1.2 ms of copying in 3-4 ms while the loader unpickled. The copying is now one job
# shared by every thread and the loader (ds-native's Crc32CopyJob, see [Note: spans shared
# among threads] in its csrc/crc32.c): each thread runs it from the start in one native call,
# taking spans (tensors) until none is left, and the loader at the verdict takes the spans no
# thread has, then waits for those being copied (:func:`shared_copy`).
_AHEAD_JOB = 48 << 20


def ahead_jobs(spans: Sequence[tuple[int, int]], threads: int) -> list[list[tuple[int, int]]]:
    """``(offset, bytes)`` spans of a file in runs, one job each, for ``threads`` checksum
    threads hashing it ahead of the loader (see [Note: jobs hashing ahead])."""
    share = sum(n for _, n in spans) // max(1, threads)
    return runs(spans, lambda span: span[1], max(share, _AHEAD_JOB))


def batches(tensors: Sequence[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    """Named tensors in :func:`runs` by their bytes."""
    return runs(tensors, lambda named: tensor_span(named[1])[1])


def fusable(record: Mapping[str, Any]) -> bool:
    """Whether a file's record lets it be checked from the loader's tensors (it lists them and
    the CRC-32 of the bytes between them)."""
    return bool(record.get("tensors")) and "gaps_crc32" in record


def gap_spans(tensors: Mapping[str, Mapping[str, Any]], size: int) -> list[tuple[int, int]]:
    """``(start, length)`` of every byte range of a ``size``-byte file outside ``tensors``'
    ``[offset, offset + nbytes)``, in file order."""
    spans = []
    at = 0
    for start, stop in sorted(
        (int(e["offset"]), int(e["offset"]) + int(e["nbytes"])) for e in tensors.values()
    ):
        if start > at:
            spans.append((at, start - at))
        at = max(at, stop)
    if size > at:
        spans.append((at, size - at))
    return spans


def _listed(name: str, manifest_name: str) -> bool:
    return name != manifest_name and not name.startswith(".")


def listing(directory: Path, manifest_name: str) -> list[str]:
    """Every file under ``directory`` (relative, ``/``-separated, sorted) but ``manifest_name``
    and hidden files: what a directory manifest must list (one ``scandir`` per folder)."""
    found: list[str] = []

    def scan(folder: str, prefix: str) -> None:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    scan(entry.path, f"{prefix}{entry.name}/")
                elif entry.is_file() and _listed(entry.name, manifest_name):
                    found.append(prefix + entry.name)

    scan(str(directory), "")
    return sorted(found)


def holds_value(name: str, values: Collection[str]) -> bool:
    """Whether the shard file entry ``name`` (``<param>/<value>``) stores one of ``values``."""
    return name.rpartition("/")[2] in values


def wanted_tensors(
    record: Mapping[str, Any],
    shard_file: bool,
    values: Collection[str] | None,
    unused: Collection[str] = (),
) -> list[str]:
    """The tensors of a file a load uses: all but those named ``unused``, and in a ZeRO shard
    file read for ``values`` only, the tensors of those values (see [Note: a path verifies what
    it uses])."""
    entries = record.get("tensors") or {}
    if values is None or not shard_file:
        return [n for n in entries if n not in unused]
    return [n for n in entries if holds_value(n, values) and n not in unused]


class HelpedPool:
    """Checksum threads whose jobs the thread waiting for them may take over: a job no thread
    has started when :meth:`help` is called runs there (last first, as the threads take them
    first first), so a loader waiting for the verdict hashes too instead of idling."""

    def __init__(self, threads: int) -> None:
        # The threads outlive one verification: starting them cost about 2 ms a load, a
        # tenth of a small weights-only load; the first load does not wait for them to start
        # either (see [Note: starting the checksum threads]). Keyed by process too: a forked
        # child gets its own threads.
        key = (os.getpid(), threads)
        pool = _POOLS.get(key)
        if pool is None:
            pool = _POOLS[key] = Workers(threads, "ds-verify")
        self._pool = pool
        # Each job's [fn, args]: the workers' queue holds the list, not the arguments, so a
        # job cancelled there (taken over, or dropped) lets go of them (the loader's tensors, a
        # copy buffer to keep) at once, not when a thread next takes it off the queue.
        self._specs: dict[Future[Any], list[Any]] = {}
        self._taken: dict[Future[Any], Future[Any]] = {}

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """``fn(*args)`` on a thread (or in :meth:`help`)."""
        spec = [fn, args]
        job = self._pool.submit(_run_spec, spec)
        self._specs[job] = spec
        return job

    def run_here(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """``fn(*args)`` run now, on this thread, as a finished job (one taken over by
        :meth:`help`)."""
        done: Future[Any] = Future()
        try:
            done.set_result(fn(*args))
        except Exception as exc:  # raised where the result is asked for
            done.set_exception(exc)
        return done

    def defer(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        """``fn(*args)`` as a job no thread takes: it runs in :meth:`help`, or here when its
        :meth:`result` is asked for first."""
        job: Future[Any] = Future()
        self._specs[job] = [fn, args]
        return job

    def later(self, fn: Callable[..., Any], *args: Any) -> None:
        """``fn(*args)`` on a thread, unwatched (clean-up nobody waits for)."""
        self._pool.submit(fn, *args)

    def help(self, jobs: Sequence[Future[Any]]) -> None:
        """Run here each of ``jobs`` (from the last) that no thread has started."""
        for job in reversed(jobs):
            spec = self._specs.get(job)
            if spec and job.cancel():
                fn, args = spec
                spec.clear()
                self._taken[job] = self.run_here(fn, *args)

    def result(self, job: Future[Any]) -> Any:
        """``job``'s result, wherever it ran (a deferred job nobody helped with runs now)."""
        if job not in self._taken and not job.running() and not job.done():
            self.help([job])
        # get, not pop: asked again, a job taken over gives its result again (its own future
        # is cancelled), as a Future's result does
        return self._taken.get(job, job).result()

    def settle(self, jobs: Sequence[Future[Any]]) -> list[Future[Any]]:
        """Drop those of ``jobs`` no thread has started (letting go of their arguments) and
        return the others, started or done."""
        started = []
        for job in jobs:
            spec = self._specs.get(job)
            if job.cancel():
                if spec is not None:
                    spec.clear()
            else:
                started.append(job)
        return started

    def shutdown(self) -> None:
        """Drop the jobs no thread has started, wait for the started ones, and let go of the
        jobs' arguments (the loader's tensors). The threads stay for the next verification."""
        wait(self.settle(list(self._specs)))
        self._specs.clear()
        self._taken.clear()


def shared_copy(
    pool: HelpedPool,
    mapped: MappedFile,
    spans: Sequence[tuple[int, int]],
    places: Sequence[tuple[torch.Tensor, Sequence[int], Sequence[int]]],
    threads: int,
) -> Future[list[int]]:
    """The job giving the CRC-32s of ``mapped``'s spans copied into ``places`` (see
    :meth:`MappedFile.copy_job`): ``threads`` checksum threads copy from now on, and the loader,
    when it asks (or helps at the verdict), copies the spans none has taken yet, then waits for
    those still being copied (see [Note: jobs hashing ahead]). A file shorter than the spans
    is the job's error, as a hashing job's is."""
    job: Future[list[int]] = Future()
    try:
        copying = mapped.copy_job(spans, places)
    except ValueError as exc:
        job.set_exception(exc)
        return job
    helpers = [pool.submit(copying.run) for _ in range(threads)]
    return pool.defer(_copied, pool, copying, helpers)


def _copied(pool: HelpedPool, copying: FileCopy, helpers: Sequence[Future[None]]) -> list[int]:
    copying.run()
    for helper in pool.settle(helpers):  # started: wait for the span it is copying
        helper.result()
    return copying.crcs()


def _run_spec(spec: list[Any]) -> Any:
    """A :class:`HelpedPool` job on its thread: ``fn(*args)`` of its ``[fn, args]``."""
    fn, args = spec
    return fn(*args)


def loaded_matches(
    record: Mapping[str, Any],
    wanted: Sequence[str],
    loaded: Mapping[str, tuple[str, list[int], int]],
    size: int,
    gaps_crc: int,
) -> bool:
    """Whether a file of ``size`` bytes whose gaps hash to ``gaps_crc``, and of which the loader
    read ``loaded`` (name -> dtype, shape, CRC-32), matches its manifest ``record`` in every
    tensor of ``wanted`` (see [Note: verifying what the loader read])."""
    if size != record["bytes"] or gaps_crc != record["gaps_crc32"]:
        return False
    entries = record["tensors"]
    for name in wanted:
        entry = entries[name]
        if loaded.get(name) != (entry["dtype"], list(entry["shape"]), entry["crc32"]):
            return False
    return True


def read_parts(
    record: Mapping[str, Any], size: int, chunk: int, values: Collection[str]
) -> tuple[list[int], list[str]]:
    """What a load reading only ``values`` of a shard file uses (see [Note: a path verifies
    what it uses]): the chunks holding the file's non-tensor bytes (the pickle and the zip
    directory, before the first tensor and after the last), and the tensors of ``values``
    outside those chunks, each checked by its own CRC-32."""
    entries = record.get("tensors") or {}
    if not entries:
        return list(range(len(chunks(size, chunk)))), []
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


def partial_problem(
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


def dtype_of(entry: Mapping[str, Any]) -> torch.dtype:
    """The torch dtype recorded for a manifest tensor entry (``"torch.bfloat16"`` ...)."""
    dtype = getattr(torch, str(entry["dtype"]).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {entry['dtype']!r} in the manifest")
    return dtype
