"""Parameter shards on NVMe (ZeRO-Infinity's ``offload_param.device = "nvme"``).

[Note: the NVMe shard store]
:class:`NvmeShardStore` satisfies the partitioner's :class:`~ds_zero._partitioned.ShardStore`
protocol. Every shard has one file, ``<folder>/param<ds_id>.swp``, written through
ds-offload-aio's ``AsyncTensorSwapper`` (page-locked staging buffers, O_DIRECT). A shard is
*resident* when its values are in host memory as ``p.ds_tensor``; otherwise ``p.ds_tensor`` is a
``meta`` tensor of the shard's size and dtype, so code that asks its size still works and code
that reads it without a ``fetch`` fails loudly instead of reading stale values.

- ``fetch`` makes shards resident (waiting for their prefetch, or reading them now) and marks
  them in use; ``prefetch`` starts the reads of non-resident shards and returns.
- ``evict`` writes back shards changed since the file was last written, and ends their use. A
  shard counts as changed when ``p.ds_tensor`` is another tensor than the one the store
  synchronised, or that tensor's version counter moved (every in-place write bumps it), so
  unchanged shards are never rewritten.
- Host copies of shards not in use are dropped, least recently used first, whenever more than
  ``max_in_cpu`` elements are resident (DeepSpeed's meaning of ``max_in_cpu``): with the
  default of 1e9 elements small models stay in host memory after their first write.

Shards in use are never dropped, so a fetch larger than ``max_in_cpu`` still succeeds. The store
holds parameters weakly: one its model dropped (a weight replaced by tying during ``Init``) takes
its host copy and its file along once it is garbage-collected.
"""

# DeepSpeed's ZeRO-3 parameter attributes (p.ds_id, p.ds_tensor, p.ds_status, ...) are set on
# torch Parameters at run time, which the type checker cannot see.
# pyright: reportAttributeAccessIssue=false

from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from ds_comm.accelerator import get_accelerator
from ds_zero.api import ConfigError, TensorSwapper

if TYPE_CHECKING:
    from ds_zero.api import OffloadParamConfig

__all__ = ["NvmeShardStore"]

# Staging buffers larger than this buy nothing: the swapper streams bigger shards through them
# piece by piece, with the copy of one piece overlapping the disk transfer of the next.
_MAX_STAGING_BYTES = 16 << 20


@dataclass
class _Shard:
    """What the store knows of one parameter's shard."""

    owner: weakref.ref[torch.nn.Parameter]
    path: str
    numel: int
    dtype: torch.dtype
    synced: torch.Tensor | None = None  # the host tensor whose values the file holds
    version: int = -1  # synced._version when the file was written or read
    in_use: bool = False
    reading: torch.Tensor | None = None  # destination of a prefetch in flight


def _import_aio() -> Any:
    try:
        import ds_offload_aio
    except ImportError as exc:
        raise ConfigError(
            'zero_optimization.offload_param.device = "nvme" stores parameter shards through '
            "ds-offload-aio, which is not installed: pip install ds-zero[nvme] (or pass swapper=)"
        ) from exc
    return ds_offload_aio


def _aio_swapper(buffer_bytes: int, buffer_count: int) -> TensorSwapper:
    aio = _import_aio()
    pool = aio.PinnedBufferPool(buffer_bytes=buffer_bytes, count=max(2, buffer_count))
    return aio.AsyncTensorSwapper(aio.AioHandle(), pool)


class NvmeShardStore:
    """Keeps stage 3 parameter shards in files, at most ``max_in_cpu`` elements in host memory
    (see [Note: the NVMe shard store]).

    Args:
        folder: this rank's directory for the shard files (created).
        swapper: moves tensors to and from files (None: ds-offload-aio's ``AsyncTensorSwapper``
            with DeepSpeed's default ``aio`` settings, built on first use).
        buffer_count: staging buffers of the default swapper (at least 2).
        buffer_size: elements per staging buffer of the default swapper (capped at 16 MiB).
        max_in_cpu: elements of shards not in use that may stay in host memory.
        pin_memory: page-locked host shards (CUDA only: faster copies to the device).

    Raises:
        ConfigError: no ``swapper`` and ds-offload-aio is not installed.

    Example:
        >>> store = NvmeShardStore("/local_nvme/ds_zero_params/rank0", max_in_cpu=10**8)
        >>> partitioner = ParamPartitioner(group, offload=offload_param, shard_store=store)
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        *,
        swapper: TensorSwapper | None = None,
        buffer_count: int = 5,
        buffer_size: int = 100_000_000,
        max_in_cpu: int = 1_000_000_000,
        pin_memory: bool = False,
    ) -> None:
        if max_in_cpu < 0:
            raise ValueError(f"max_in_cpu = {max_in_cpu!r}: expected an integer >= 0")
        if swapper is None:
            _import_aio()  # fail at construction, not at the first swap
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._swapper = swapper
        self._buffer_bytes = min(max(1, int(buffer_size)) * 4, _MAX_STAGING_BYTES)
        self._buffer_count = buffer_count
        self.max_in_cpu = max_in_cpu
        self.pin_memory = pin_memory and get_accelerator().pins_host_memory()
        self._shards: dict[int, _Shard] = {}
        # Resident shards, least recently used first. Parameters are held weakly (_Shard.owner):
        # one dropped by its model (e.g. replaced by tying) takes its host copy and file along.
        self._resident: OrderedDict[int, None] = OrderedDict()
        self._pending: dict[int, torch.nn.Parameter] = {}  # prefetched, not installed yet
        self._resident_numel = 0
        self._dead: list[int] = []  # ds_ids of parameters garbage-collected since last looked
        self.reads = self.writes = 0  # shards read from / written to files

    @classmethod
    def from_config(
        cls, offload: OffloadParamConfig, rank: int, *, swapper: TensorSwapper | None = None
    ) -> NvmeShardStore:
        """The store for ``offload_param`` on group rank ``rank``: files under
        ``<nvme_path>/ds_zero_params/rank<rank>/``."""
        if offload.device != "nvme" or not offload.nvme_path:
            raise ConfigError(
                f"zero_optimization.offload_param = {offload!r}: the NVMe store needs "
                'device "nvme" and an nvme_path'
            )
        return cls(
            Path(offload.nvme_path, "ds_zero_params", f"rank{rank}"),
            swapper=swapper,
            buffer_count=offload.buffer_count,
            buffer_size=offload.buffer_size,
            max_in_cpu=offload.max_in_cpu,
            pin_memory=offload.pin_memory,
        )

    @property
    def swapper(self) -> TensorSwapper:
        if self._swapper is None:
            self._swapper = _aio_swapper(self._buffer_bytes, self._buffer_count)
        return self._swapper

    @property
    def pinned_bytes(self) -> int:
        """Page-locked staging memory of the swapper (0 before the first transfer builds it)."""
        return int(getattr(self._swapper, "pinned_bytes", 0) or 0) if self._swapper else 0

    @property
    def resident_numel(self) -> int:
        """Elements of shards in host memory now."""
        self._forget_dead()
        return self._resident_numel

    def is_resident(self, p: torch.nn.Parameter) -> bool:
        """True when ``p.ds_tensor`` holds the shard's values in host memory."""
        return p.ds_id in self._resident

    # --- the ShardStore protocol ------------------------------------------------------------------

    def fetch(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Make every ``p.ds_tensor`` resident and mark it in use until its :meth:`evict`."""
        self._start_reads(params)
        self._drain()
        for p in params:
            self._shard(p).in_use = True
            self._resident.move_to_end(p.ds_id)
        self._trim()

    def prefetch(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Start reading the shards of ``params`` that are not resident; returns at once."""
        self._start_reads(params)

    def evict(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Write back the shards changed since they were last synchronised, end their use, and
        drop host copies beyond ``max_in_cpu``."""
        dirty = []
        for p in params:
            shard = self._shard(p)
            shard.in_use = False
            if p.ds_id not in self._resident and not self._adopt(p):
                continue
            self._resident.move_to_end(p.ds_id)
            t = p.ds_tensor
            if t is not shard.synced or t._version != shard.version:
                dirty.append(p)
        if dirty:
            tensors = [p.ds_tensor.reshape(-1) for p in dirty]
            self.swapper.swap_out(tensors, [self._shards[p.ds_id].path for p in dirty])
            for p in dirty:
                self._mark_synced(p, p.ds_tensor)
            self.writes += len(dirty)
            self._install_pending()  # swap_out waited for the prefetches queued before it too
        self._trim()

    # --- internals --------------------------------------------------------------------------------

    def _shard(self, p: torch.nn.Parameter) -> _Shard:
        shard = self._shards.get(p.ds_id)
        if shard is not None:
            return shard
        t = p.ds_tensor
        if t.device.type == "meta":
            raise ValueError(
                f"parameter {getattr(p, 'ds_name', None) or p.ds_id} has no shard in host memory "
                "and none in this store's files; shards enter the store through evict()"
            )
        owner = weakref.ref(p, lambda _, key=p.ds_id, dead=self._dead: dead.append(key))
        shard = _Shard(owner, str(self.folder / f"param{p.ds_id}.swp"), t.numel(), t.dtype)
        self._shards[p.ds_id] = shard
        self._add_resident(p.ds_id)  # never written: dirty until the first evict
        return shard

    def _add_resident(self, key: int) -> None:
        self._resident[key] = None
        self._resident_numel += self._shards[key].numel

    def _adopt(self, p: torch.nn.Parameter) -> bool:
        """A shard someone replaced with a real tensor while it was not resident (e.g. loaded
        from a checkpoint): those values win; resident and unwritten from now."""
        if p.ds_tensor.device.type == "meta":
            return False
        self._shards[p.ds_id].synced = None
        self._add_resident(p.ds_id)
        return True

    def _mark_synced(self, p: torch.nn.Parameter, tensor: torch.Tensor) -> None:
        shard = self._shards[p.ds_id]
        shard.synced, shard.version = tensor, tensor._version

    def _start_reads(self, params: Sequence[torch.nn.Parameter]) -> None:
        todo = []
        for p in params:
            shard = self._shard(p)
            if p.ds_id in self._resident or p.ds_id in self._pending or self._adopt(p):
                continue
            shard.reading = torch.empty(
                shard.numel, dtype=shard.dtype, device="cpu", pin_memory=self.pin_memory
            )
            self._pending[p.ds_id] = p
            todo.append(p)
        if todo:
            reads = [self._shards[p.ds_id].reading for p in todo]  # each set just above
            self.swapper.swap_in(
                cast("list[torch.Tensor]", reads),
                [self._shards[p.ds_id].path for p in todo],
                async_op=True,
            )

    def _drain(self) -> None:
        """Complete every transfer in flight and install the shards read."""
        if self._pending:
            self.swapper.wait()
            self._install_pending()

    def _install_pending(self) -> None:
        for key, p in self._pending.items():
            shard = self._shards[key]
            tensor, shard.reading = shard.reading, None
            assert tensor is not None  # a pending shard has its read buffer
            if key in self._resident:  # adopted a newer tensor while the read was in flight
                continue
            p.ds_tensor = tensor
            self._mark_synced(p, tensor)
            self._add_resident(key)
            self.reads += 1
        self._pending.clear()

    def _trim(self) -> None:
        """Drop the least recently used host copies not in use while over ``max_in_cpu``."""
        excess = self.resident_numel - self.max_in_cpu  # forgets dead parameters first
        for key in list(self._resident):
            if excess <= 0:
                break
            shard = self._shards[key]
            p = shard.owner()
            if p is None or shard.in_use or p.ds_tensor is not shard.synced:
                continue  # in use, or changed and not written back yet
            if p.ds_tensor._version != shard.version:
                continue
            p.ds_tensor = torch.empty(shard.numel, dtype=shard.dtype, device="meta")
            shard.synced = None
            del self._resident[key]
            self._resident_numel -= shard.numel
            excess -= shard.numel

    def _forget_dead(self) -> None:
        """Drop the host copies and files of shards whose parameter no longer exists."""
        while self._dead:
            key = self._dead.pop()
            shard = self._shards.pop(key, None)
            if shard is None:
                continue
            if key in self._resident:
                del self._resident[key]
                self._resident_numel -= shard.numel
            Path(shard.path).unlink(missing_ok=True)

    def close(self) -> None:
        """Wait for transfers in flight and delete this store's files."""
        self._drain()
        for shard in self._shards.values():
            Path(shard.path).unlink(missing_ok=True)
