"""A shard file's tensors copied out of its mapping as they are hashed, for the loader to use
once the verdict is in.

[Note: copying while verifying]
A ZeRO-3 load of the fp32 masters alone (``load_optimizer_states=False``) hashed the masters
from the page cache on a checksum thread (see [Note: hashing ahead of the loader]) and, after
the verdict, the loading thread copied each one out of the shard file's mapping into a tensor
of its own: two passes over the same bytes, the second on the load's critical path, faulting
in the mapping's pages. Where ds-native's ``crc32_copy_spans`` is built, the checksum thread
instead copies each 64 KiB block of the masters into tensors of their own and hashes it from
there while the cache holds it (ds-native's [Note: copying while hashing]): one pass over the
file, beside the loader's unpickling. After the verdict the loader takes each master as that
tensor (the :class:`~ds_zero._manifest.ShardReader` lookup of a range one piece holds is a view
of it), with no copy and no fault on the mapping. The values used are then the very bytes whose
CRC-32 matched the manifest: a file rewritten in place after the check is no longer read after
it. A copy that did not match fails the verdict ("what was read differs from the manifest"),
even if the file is put right before it, so no unmatched copy is ever used.

The copies hold every wanted tensor of a file at once, until the load ends, where the loader
held one at a time; so this is done for at most :data:`COPY_AHEAD_BYTES` per load. A full load
copies its shard files too, masters and optimizer state, and reads them after the verdict (see
``_checkpoint.py``'s [Note: reading the copies after the verdict]); the model file is copied in
either (see [Note: copying the file the loader reads whole]). Beyond the budget, or without the
kernel, the tensors are hashed in place and read from the file, as before.
The copies of a file are carved out of one buffer allocated on the loading thread and left
untouched there: the copying threads fault its pages in as they write. Fresh 4 KiB pages cost
about as much as the copy itself (the 2-core VM wrote 40 MB into fresh pages in 31 ms, into
memory written before in 6.4 ms). Allocated with ``torch.empty`` a tensor at a time, as they
were, the copies got fresh pages whenever glibc's malloc had returned the last load's to the
system: in every load on the idle 16-core host (11,336 faults a 10M-parameter load), in about
half of them on the VM, and in a job's one load always. So where Linux offers transparent
huge pages (``always`` or ``madvise`` in ``/sys/kernel/mm/transparent_hugepage/enabled``), a
buffer of 2 MiB or more is an anonymous mapping aligned to 2 MiB and advised
``MADV_HUGEPAGE``: one fault per 2 MiB page instead of one per 4 KiB page (40 MB into fresh
huge pages: 8.8 ms on the VM). On the host that load's faults went to 1,106-1,115, its copying
thread's time from 27-35 ms to 14-19 ms, and the loader's wait for the verdict from 19-27 ms
to 5-10 ms (8 processes each way, ``checkpoint_verify.py --phases``). Elsewhere the buffer is
``torch.empty``'s. At the end of the load the buffer is kept for the next one (see [Note: copy
buffers kept for the next load]). The kernel may back part of it with 4 KiB pages (no free
huge page): the old cost, not an error.
ds-offload-aio's locked buffers are mapped the same way ([Note: huge pages for locked
buffers]); that allocator is not called here because ds-zero does not depend on ds-offload-aio
(an extra, for NVMe offload), and because it locks its memory, or pins it where CUDA is,
which copies read once need not pay for. A change to one mapping should be made to both.

The check now does work the loader did: against a loader that copied ahead on a thread of its
own without hashing, the check's own cost is the CRC-32 of blocks in the cache (ds-native's
copy-and-hash took 10.8 ms for 40 MB on the 2-core VM, the copy alone 7.0 ms:
``tools/bench/crc32.py``).

[Note: copy buffers kept for the next load]
Fresh huge pages still cost their faults and the kernel's zeroing, and on the 2-core VM (a
Firecracker guest) sometimes much more. ``tools/bench/copy_buffers.py --mb 40 --processes 6``
copies and hashes 40 MB on a thread, 54 times into a new mapping and 54 times into the one the
last round released: new, median 16.7 ms, 90th percentile 88.1 ms, slowest 98.0 ms, 7.0 ms of it
in the kernel (median), 20 faults; kept, 11.3, 12.9 and 14.3 ms, no kernel time, no fault. Every
process had slow rounds in new memory (the host behind the guest backing the pages again, it
seems: the guest had 20 GB free and no compaction stalls), and they made
``checkpoint_verify.py``'s ZeRO-3 weights-only row swing from -10% to +150% between processes. A
baseline load that reuses glibc's freed memory (as the unverified load does in some processes)
pays for no fresh page either.
So :meth:`CopiedTensors.release` (at the end of the load, once no checksum job runs) keeps the
buffer's region for the next load in this process, advised ``MADV_FREE``: the kernel may take
its pages back under memory pressure (they are then fresh, zeroed pages again, which the copies
overwrite), and until it does the next load writes them with no system call and no fault. A load
takes the smallest kept region that holds its file's copies, or maps a new one. A region some
tensor still views (``iter_fp32_tensors`` hands the copies out; a loader that kept one) is never
kept, so no one's values are overwritten: each ``torch.frombuffer`` storage holds a reference to
the mapping until its last tensor is freed, which :meth:`_Region.viewed` counts. A copying job
the waiting loader took over, or that the end of the load dropped, lets go of its copies at once
(``HelpedPool`` queues a job's arguments in a list it empties), or the buffer would look viewed
until a thread took the cancelled job off the queue. A process keeps at most :data:`_KEEP_BYTES`
(512 MiB, one load's :data:`COPY_AHEAD_BYTES`), unmapping the largest kept regions beyond it; a
forked child keeps none of its parent's. The cost: after a masters-only load the process holds
up to that much lazily freed memory, counted in its RSS until the kernel takes it.

[Note: copying the file the loader reads whole]
The model file (``mp_rank_XX_model_states.pt``, every weight of a ZeRO-1/2 model) was read by
the loader with ``torch.load`` into memory of its own, while a checksum thread hashed the same
bytes from its own mapping of the file: two passes over them, on two cores, and the loader's
one wrote 42 MB into fresh pages (10,251 faults on a 10M-parameter load). Now a file named in
``start_verification(loaded=...)`` and hashed from the disk is copied out as it is hashed, as
the masters are: :meth:`~ds_zero._integrity.PendingVerification.copying` says so, the loader
maps the file (``torch.load(mmap=True)``: the pickle and zip headers read, no tensor's bytes)
and, after the verdict, :meth:`~ds_zero._integrity.PendingVerification.verified_object` swaps
every tensor of what it loaded for its copy (a strided one for the same view of its storage's
copy; one the manifest cannot list, with no bytes, for a clone; tensors that shared a storage
in the file get a copy each, so they no longer share one). So the values used are the
bytes that were checked, as for the masters: a model file rewritten in place after the verdict
is not read, where the mapping the loader holds would have shown the new bytes. The copies
take the place of ``torch.load``'s memory (no more memory than before during the load) and
count against :data:`COPY_AHEAD_BYTES`. A model file past it, or without the kernel, or on a
machine with no core to spare (the file then hashed from the loader's tensors), is read as
before. A model file on the disk (not in the page cache) is copied too. It was not, on the
strength of a measurement that a mapping faulted in page by page read 400 MB in 1.4-1.6 s
against ``torch.load``'s 0.66 s; but that mapping was faulted by Python code on the loading
thread, and one native call sweeping the file in order is as fast as ``torch.load``'s reads
(on the 2-core VM, cold, a 42 MB file: 38.8 ms against 38.9 ms; 400 MB: 278 ms against 315
ms), whereas a thread hashing the file beside the loader's reads, the two contending for
its pages, cost the cold 10M-parameter ZeRO-2 weights-only load about 10%; copied, that load
is faster than unchecked (``docs/checkpoints.md``, eighteenth follow-up). ds-engine drops the
module's state dict once it is loaded, so the buffer is kept for the next load unless
something else (the client state) still views it.

What it buys depends on the memory ``torch.load`` would have read into. On the 2-core VM,
10M-parameter ZeRO-2 weights-only loads (``checkpoint_verify.py --params 10 --rounds 7
--processes 20``, the median paired overhead of each process): where the unchecked load wrote
fresh pages (10,251 faults), the checked one is 37-46% faster (it was 3% slower); where glibc
handed the unchecked load memory it had written before, the checked one is 6-21% slower (it
was about 8% slower): the checksum thread's copy-and-hash (11-12 ms for 42 MB) is then longer
than ``torch.load``'s plain copy (about 10 ms), and the loading core waits for it. A ZeRO-2
full load, which reads the model file too, went from +1-2% to -11.5%. Against a loader that
maps the model file and uses its tensors in place, with no copy and no check
(``--mapped-baseline``), the check costs +49% at ZeRO-2 weights only: there the copy-and-hash
is all added work, on a machine where it runs at memory speed. So where the weights go on
into the fp32 masters, ds-engine names the masters as the copies' destination
(``start_verification(into=...)``, see its [Note: weights loaded into the masters]): the copy
is then one the load makes anyway, and that row went to -3.8% on the same machine.
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ds_zero._read_checks import dtype_of, map_tensors
from ds_zero._sealed import CheckpointError

__all__ = ["COPY_AHEAD_BYTES", "CopiedTensors", "copy_buffer", "huge_pages_offered"]

COPY_AHEAD_BYTES = 512 << 20
"""The most bytes of tensors one load copies out while hashing (see [Note: copying while
verifying]); a file that would pass it is hashed in place."""

_ALIGN = 64  # each copy's first byte (a cache line; a multiple of every dtype's size)
_HUGE_PAGE = 2 << 20


@functools.lru_cache(maxsize=1)
def huge_pages_offered() -> bool:
    """Whether this kernel backs anonymous memory advised ``MADV_HUGEPAGE`` with transparent
    huge pages (Linux, THP ``always`` or ``madvise``)."""
    if getattr(mmap, "MADV_HUGEPAGE", None) is None:
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


class _Region:
    """An anonymous mapping advised huge pages, 2 MiB-aligned inside, that copy buffers are
    lent from (see [Note: copy buffers kept for the next load])."""

    def __init__(self, nbytes: int) -> None:
        self._mapping = mmap.mmap(
            -1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        )
        with contextlib.suppress(OSError):  # a kernel built without THP: 4 KiB pages
            self._mapping.madvise(mmap.MADV_HUGEPAGE)
        self.capacity = nbytes

    def lend(self, nbytes: int) -> torch.Tensor:
        """The region's first ``nbytes`` (from its first 2 MiB boundary) as a uint8 tensor; the
        tensor, and every view of it, holds the mapping."""
        whole = torch.frombuffer(self._mapping, dtype=torch.uint8)
        skip = -whole.data_ptr() % _HUGE_PAGE
        return whole[skip : skip + nbytes]

    def viewed(self) -> bool:
        """Whether a tensor still views the region (each ``torch.frombuffer`` storage holds a
        reference to the mapping until its last tensor is freed)."""
        return sys.getrefcount(self._mapping) > 2  # this attribute, and the call's argument

    def set_aside(self) -> None:
        """Let the kernel take the pages back under memory pressure, without a system call or
        a fault on the next lending while it has not (``MADV_FREE``; an unviewed region, whose
        next copies write every byte they read back)."""
        if getattr(mmap, "MADV_FREE", None) is not None:
            with contextlib.suppress(OSError):  # a kernel before Linux 4.5: stays resident
                self._mapping.madvise(mmap.MADV_FREE)

    def close(self) -> None:
        """Unmap the region (an unviewed one)."""
        self._mapping.close()


_KEEP_BYTES = COPY_AHEAD_BYTES
"""The most bytes of copy buffers a process keeps between loads (what one load copies)."""

_kept: list[_Region] = []
_kept_lock = threading.Lock()


def _forget_kept() -> None:
    """In a forked child: none of the parent's regions, and a lock no parent thread holds."""
    global _kept, _kept_lock
    _kept, _kept_lock = [], threading.Lock()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_kept)


def _take(nbytes: int) -> _Region | None:
    """The smallest kept region of ``nbytes`` or more, taken out of the kept ones; None if
    there is none."""
    with _kept_lock:
        fits = [r for r in _kept if r.capacity >= nbytes]  # none viewed (see _keep)
        if not fits:
            return None
        region = min(fits, key=lambda r: r.capacity)
        _kept.remove(region)
        return region


def _keep(region: _Region) -> None:
    """Keep ``region`` (no tensor views it) for a later load, advised ``MADV_FREE``, unmapping
    the largest kept ones beyond :data:`_KEEP_BYTES`."""
    region.set_aside()
    with _kept_lock:
        _kept.append(region)
        while sum(r.capacity for r in _kept) > _KEEP_BYTES:
            largest = max(_kept, key=lambda r: r.capacity)
            _kept.remove(largest)
            largest.close()


def copy_buffer(nbytes: int) -> tuple[torch.Tensor, _Region | None]:
    """``nbytes`` of memory for a file's copies, as a uint8 tensor, and the region it is lent
    from (None: ``torch.empty``'s memory). For 2 MiB or more where the kernel offers
    transparent huge pages, a region kept from an earlier load, else a new one; otherwise
    ``torch.empty`` (see [Note: copying while verifying])."""
    if nbytes < _HUGE_PAGE or not huge_pages_offered():
        return torch.empty(nbytes, dtype=torch.uint8), None
    region = _take(nbytes) or _Region(nbytes)
    return region.lend(nbytes), region


class CopiedTensors:
    """Tensors of one file (named as in its manifest record), each copied into bytes of its own
    in one buffer (:func:`copy_buffer`), or into memory the caller named (``into``, see
    ds-engine's [Note: weights loaded into the masters]), by checksum jobs over consecutive
    runs of them (see [Note: copying while verifying]); read with :meth:`tensor` or
    :meth:`view_as` only once those jobs are done and matched. Built with :meth:`of`.

    A load takes each tensor once, after the verdict, so the tensors are made then, one
    ``as_strided`` each; before it a copying job gets each destination and each tensor's byte
    offset in it (``crc32_copy_spans(at=...)``): no torch call per tensor on the loading thread
    before the verdict, nor on the copying threads, whose Python work holds the GIL beside the
    loader's unpickling. Three views a tensor made up front cost a 100M-parameter model file
    (762 tensors) 2 ms of the loading thread before the verdict on the 2-core VM
    (``start_verification`` 5.8 ms, then 3.7 ms; at 10M, 1.26 ms, then 0.67 ms:
    ``checkpoint_verify.py --stage 2 --no-optimizer-states --phases``)."""

    def __init__(
        self,
        spots: dict[str, tuple[int, int, torch.dtype, list[int], int]],
        end: int,
        nbytes: int,
        targets: Sequence[torch.Tensor] = (),
    ) -> None:
        """``spots``: each tensor's byte offset in its destination, byte count, dtype, shape
        and destination (0: the buffer; ``i``: ``targets[i - 1]``, the bytes of a storage the
        caller named); ``end``: where the buffer's last tensor ends; ``nbytes``: the buffer's
        tensors' bytes in all (see :meth:`of`)."""
        # Allocated here, untouched: the copying threads write every byte.
        memory, self._region = copy_buffer(-(-end // _ALIGN) * _ALIGN)  # whole dtypes
        self._destinations: list[torch.Tensor] = [memory, *targets]
        self._spots = spots
        self._typed: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._order = list(spots)
        self._handed = 0
        self.nbytes = nbytes
        self.into = bool(targets)
        """Whether tensors are copied into the memory the caller named (all it named)."""

    @classmethod
    def of(
        cls,
        entries: Mapping[str, Mapping[str, Any]],
        order: Sequence[str],
        *,
        into: Mapping[str, torch.Tensor] | None = None,
        budget: int = COPY_AHEAD_BYTES,
        into_only: bool = False,
    ) -> CopiedTensors | None:
        """The copies of tensors ``order`` (in this order in the buffer, 64-byte aligned), or
        None when one of them has an unknown dtype or a shape whose elements times the dtype's
        size is not its recorded byte count (the manifest is then wrong, and the check says
        so: nothing is copied), or when the buffer would pass ``budget`` bytes. ``into``: the
        tensors named there are copied into those tensors (contiguous, on the CPU, sharing no
        memory with each other) instead of the buffer, if every one of them is in ``order``
        with its dtype and byte count; otherwise none is. ``into_only``: None too unless every
        tensor of ``order`` goes into ``into`` (no buffer)."""
        recorded = {}
        for name in order:
            entry = entries[name]
            try:
                dtype = dtype_of(entry)
            except CheckpointError:
                return None
            shape, nbytes = [int(s) for s in entry["shape"]], int(entry["nbytes"])
            if math.prod(shape) * dtype.itemsize != nbytes:
                return None
            recorded[name] = (nbytes, dtype, shape)
        direct = into if into and _fitting(recorded, into) else {}
        if into_only and any(name not in direct for name in recorded):
            return None
        spots, end, total = {}, 0, 0
        targets: list[torch.Tensor] = []
        where: dict[int, int] = {}  # a storage's address: its destination
        for name, (nbytes, dtype, shape) in recorded.items():
            target = direct.get(name)
            if target is not None:
                storage = target.untyped_storage()
                if storage.data_ptr() not in where:
                    targets.append(torch.empty(0, dtype=torch.uint8).set_(storage))
                    where[storage.data_ptr()] = len(targets)
                place = target.storage_offset() * target.element_size()
                spots[name] = (place, nbytes, dtype, shape, where[storage.data_ptr()])
                continue
            end = -(-end // _ALIGN) * _ALIGN
            spots[name] = (end, nbytes, dtype, shape, 0)
            end, total = end + nbytes, total + nbytes
        if total > budget:
            return None
        return cls(spots, end, total, targets) if spots else None

    def next_run(
        self, spans: Sequence[tuple[int, int]]
    ) -> list[tuple[torch.Tensor, list[int], list[int]]]:
        """Where the next run of ``spans`` is copied (runs asked for in order): per
        destination, the destination, the indices of the spans it takes and the byte offset
        in it of each one's tensor."""
        names = self._order[self._handed : self._handed + len(spans)]
        self._handed += len(spans)
        assert self._destinations, "next_run() after release()"
        places: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
        for i, name in enumerate(names):
            at, _, _, _, destination = self._spots[name]
            _, indices, offsets = places.setdefault(
                destination, (self._destinations[destination], [], [])
            )
            indices.append(i)
            offsets.append(at)
        return list(places.values())

    def spot(self, name: str) -> tuple[torch.dtype, list[int]] | None:
        """The dtype and shape tensor ``name`` was copied as; None when it was not copied."""
        spot = self._spots.get(name)
        return None if spot is None or not self._destinations else (spot[2], spot[3])

    def tensor(self, name: str) -> torch.Tensor | None:
        """Tensor ``name`` as copied (its dtype and shape as recorded, contiguous); None when it
        was not copied."""
        spot = self._spots.get(name)
        if spot is None or not self._destinations:
            return None
        stride, size = [], 1
        for extent in reversed(spot[3]):
            stride.append(size)
            size *= extent
        return self.view_as(name, spot[3], stride[::-1], 0)

    def view_as(
        self, name: str, shape: Sequence[int], stride: Sequence[int], offset: int
    ) -> torch.Tensor:
        """The copy of tensor ``name`` (copied: see :meth:`spot`) viewed with ``shape`` and
        ``stride`` from element ``offset`` of its bytes: what a loaded tensor of the same dtype
        viewed in the file's bytes, now in the checked copy."""
        at, _, dtype, _, destination = self._spots[name]
        typed = self._typed.get((destination, dtype))
        if typed is None:
            assert self._destinations, "view_as() after release()"
            typed = self._destinations[destination].view(dtype)
            self._typed[destination, dtype] = typed
        return typed.as_strided(
            shape, stride, typed.storage_offset() + at // dtype.itemsize + offset
        )

    def swapped(self, obj: Any, path: os.PathLike[str]) -> Any:
        """``obj``, loaded from file ``path`` by ``torch.load(mmap=True)``, with each tensor
        swapped for its copy (the same view of it; a tensor the manifest does not list, one
        with no bytes, cloned). Raises CheckpointError, naming the file and the tensor, for a
        tensor whose dtype or shape in ``obj`` is not its manifest's (its copy would be read as
        something else)."""

        def verified(name: str, tensor: torch.Tensor) -> torch.Tensor:
            spot = self.spot(name)
            if spot is None:
                return tensor.clone()  # unlisted: no bytes (see _tensor_index)
            dtype, shape = spot
            if dtype != tensor.dtype or shape != list(tensor.shape):
                raise CheckpointError(
                    f"{path}: tensor {name!r} reads as {tensor.dtype} "
                    f"{list(tensor.shape)}, its manifest records {dtype} {shape}"
                )
            # The same view of the copy; a strided tensor's entry holds its whole storage.
            offset = 0 if tensor.is_contiguous() else int(tensor.storage_offset())
            return self.view_as(name, tensor.shape, tensor.stride(), offset)

        return map_tensors(obj, verified)

    def release(self) -> None:
        """Let go of the copies (the load is over): their buffer is kept for the next load if
        nothing else views it (see [Note: copy buffers kept for the next load])."""
        region, self._region = self._region, None
        self._destinations, self._typed = [], {}
        if region is not None and not region.viewed():
            _keep(region)


def _fitting(
    recorded: Mapping[str, tuple[int, torch.dtype, list[int]]], into: Mapping[str, torch.Tensor]
) -> bool:
    """Whether every tensor of ``into`` can take the bytes of the copied tensor it names (its
    recorded byte count and dtype; contiguous, on the CPU): a caller that puts back what a
    failed load wrote treats all of them alike, so one that cannot means none is used."""
    for name, target in into.items():
        found = recorded.get(name)
        if (
            found is None
            or found[1] != target.dtype
            or found[0] != target.numel() * target.element_size()
            or not target.is_contiguous()
            or target.device.type != "cpu"
        ):
            return False
    return True
