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

The copies hold every wanted master of a file at once, until the load ends, where the loader
held one tensor at a time; so this is done for at most :data:`COPY_AHEAD_BYTES` per load, and
only for a masters-only load (a full load assembles the optimizer's states range by range into
tensors of the optimizer's own, and would need three times the memory). Beyond the budget, or
without the kernel, the masters are hashed in place and copied after the verdict, as before.
The tensors are allocated on the loading thread and left untouched there: the allocator hands
back what the previous load freed, so a later load in the process faults in no new pages
(fresh pages cost the 2-core VM 35 ms per 40 MB; a first load pays them on the thread).

The check now does work the loader did: against a loader that copied ahead on a thread of its
own without hashing, the check's own cost is the CRC-32 of blocks in the cache (ds-native's
copy-and-hash took 10.8 ms for 40 MB on the 2-core VM, the copy alone 7.0 ms:
``tools/bench/crc32.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ds_zero._read_checks import dtype_of
from ds_zero._sealed import CheckpointError

__all__ = ["COPY_AHEAD_BYTES", "CopiedTensors"]

COPY_AHEAD_BYTES = 512 << 20
"""The most bytes of tensors one load copies out while hashing (see [Note: copying while
verifying]); a file that would pass it is hashed in place."""


class CopiedTensors:
    """Tensors of one file (named as in its manifest record), each copied into a tensor of its
    own by checksum jobs over consecutive runs of them (see [Note: copying while verifying]);
    read with :meth:`tensor` only once those jobs are done and matched."""

    def __init__(self, entries: Mapping[str, Mapping[str, Any]], order: Sequence[str]) -> None:
        # Allocated here, untouched: the copying threads write every byte. The allocator hands
        # back the memory the previous load freed, so a later load faults in no new pages
        # (fresh pages cost the 2-core VM 35 ms per 40 MB).
        self._tensors = {
            n: torch.empty([int(s) for s in entries[n]["shape"]], dtype=dtype_of(entries[n]))
            for n in order
        }
        self._order = list(order)
        self._handed = 0
        self.nbytes = sum(int(entries[n]["nbytes"]) for n in order)

    @staticmethod
    def possible(entries: Mapping[str, Mapping[str, Any]], order: Sequence[str]) -> bool:
        """Whether each of the tensors ``order`` has a known dtype whose size, times its shape's
        elements, is its recorded byte count (else the manifest is wrong, and the check says
        so: nothing is copied)."""
        for name in order:
            entry = entries[name]
            try:
                itemsize = dtype_of(entry).itemsize
            except CheckpointError:
                return False
            if math.prod(int(s) for s in entry["shape"]) * itemsize != int(entry["nbytes"]):
                return False
        return bool(order)

    def next_run(self, spans: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """The tensors the next run of ``spans`` is copied into (runs asked for in order)."""
        names = self._order[self._handed : self._handed + len(spans)]
        self._handed += len(spans)
        return [self._tensors[n] for n in names]

    def tensor(self, name: str) -> torch.Tensor | None:
        """Tensor ``name`` as copied (its dtype and shape as recorded); None when it was not
        copied."""
        return self._tensors.get(name)
