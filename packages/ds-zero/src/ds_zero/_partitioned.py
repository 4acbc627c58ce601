"""Partitioned parameters (ZeRO stage 3): each rank stores a 1/N flat shard of every parameter
and all-gathers the whole parameter only around its use.

[Note: partitioned parameters]
A partitioned parameter ``p`` keeps its identity (the ``torch.nn.Parameter`` object the module,
the optimizer and the user hold) while its storage changes:

- ``p.ds_tensor`` is this rank's shard: elements ``[rank * s, (rank + 1) * s)`` of the flattened
  parameter zero-padded to ``s * world_size`` elements, ``s = ceil(numel / world_size)``. It is a
  copy, so the full storage can be freed; stage 3's optimizer may later point it into its fp32
  master (same values).
- While partitioned (``ds_status`` NOT_AVAILABLE), ``p.data`` is an empty tensor of the
  parameter's dtype and device, as in DeepSpeed: code that reads a partitioned weight sees
  ``numel() == 0`` instead of stale values.
- :meth:`ParamPartitioner.gather` all-gathers the shards of several parameters in one collective
  (their shards concatenated; a single parameter straight into its whole buffer, no copy) and
  points each ``p.data`` at a contiguous tensor of its ``ds_shape`` in the parameter's *whole
  buffer* (``s * world_size`` elements, padding included). See [Note: freeing gathered storage]
  for when that buffer is reused.
- Parameters of at most ``persistence_threshold`` elements are *persistent* (``ds_persist``):
  whole on every rank, never released (DeepSpeed's ``stage3_param_persistence_threshold``:
  gathering biases and norms costs more latency than memory). They still own a shard, which is
  what the optimizer steps; after a step the shards are gathered back into the whole.
- Shards live on the compute device, in host memory (``offload_param.device == "cpu"``: copied to
  the compute device for each gather) or behind a :class:`ShardStore` (``"nvme"``), which the
  partitioner asks to ``fetch`` shards before reading or writing them and may ``evict`` after.

[Note: freeing gathered storage]
Autograd saves views of weights for backward (``F.linear`` saves ``weight.t()``,
``nn.MultiheadAttention`` saves ``in_proj_weight.chunk(3)``), and a view keeps its storage
alive: pointing ``p.data`` at an empty tensor alone would leave every weight of the forward whole
until its backward, and ZeRO-3's working set would be the whole model. So the stage 3 hooks
release with ``free_storage=True``, as FSDP2 reshards: the whole buffer's storage is resized to
0 bytes (the memory returns to the allocator even while autograd holds views of it) and the
buffer object is kept, so the next gather of the parameter (the module's pre-backward fetch)
re-grows the *same* storage and writes the same values into it, which the saved views then read.
The writes go through the buffer, a tensor of its own, so the parameter's version counter (which
its saved views share) does not move. Any other release (``GatheredParameters``, exports, the
``partition`` attribute) only drops the buffer, and the next gather allocates a fresh one, so a
whole value handed out earlier stays valid for as long as its holder keeps it.

[Note: parameters on their own group]
Some parameters are sharded over a subgroup of the data-parallel group: MoE experts over their
expert-data-parallel group (ranks of different expert-parallel rank hold different experts, so
one expert's shards live only on the ranks holding it, as DeepSpeed's ``ds_process_group`` of an
expert). :meth:`ParamPartitioner.sub_partitioner` gives the partitioner of such a group (same
offload, persistence and device; ``p.ds_partitioner`` is it), and this partitioner's
:meth:`~ParamPartitioner.gather`, :meth:`~ParamPartitioner.release` and
:meth:`~ParamPartitioner.write_full_from_shards` hand those parameters to it, so the stage 3
hooks drive one partitioner. A gather issues the subgroups' collectives first, then its own, in
the same order on every rank.
"""

# DeepSpeed's ZeRO-3 parameter attributes (p.ds_id, p.ds_tensor, p.ds_status, ...) are set on
# torch Parameters at run time, which the type checker cannot see.
# pyright: reportAttributeAccessIssue=false

from __future__ import annotations

import contextlib
import enum
import itertools
import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist

import ds_comm
from ds_comm.accelerator import get_accelerator
from ds_zero._streams import SideStream

if TYPE_CHECKING:
    from ds_zero._zeropp import WeightComm
    from ds_zero.api import OffloadParamConfig

__all__ = [
    "GatherHandle",
    "ParamPartitioner",
    "ShardStore",
    "ZeroParamStatus",
    "is_partitioned",
    "shard_bounds",
]

# ds_id numbering, unique within the process (DeepSpeed numbers parameters the same way).
_DS_IDS = itertools.count()


class ZeroParamStatus(enum.Enum):
    """Whether a partitioned parameter's whole value is in ``p.data`` (DeepSpeed's names)."""

    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


@runtime_checkable
class ShardStore(Protocol):
    """Where shards live with ``offload_param.device == "nvme"`` (ds-zero's ``_param_offload``).

    The partitioner calls :meth:`fetch` before it reads or writes ``p.ds_tensor`` and
    :meth:`evict` once it is done with them.
    """

    def fetch(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Make each ``p.ds_tensor`` resident in host memory (blocking)."""
        ...

    def prefetch(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Start reading the shards of parameters needed soon (a hint)."""
        ...

    def evict(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Write back shards changed since their fetch and free their host copies."""
        ...


def is_partitioned(p: torch.Tensor) -> bool:
    """True when ``p`` was partitioned by a :class:`ParamPartitioner`."""
    return hasattr(p, "ds_id") and hasattr(p, "ds_tensor")


def _can_pin() -> bool:
    """Page-locked host memory needs a device runtime to register it with."""
    return get_accelerator().pins_host_memory()


def shard_bounds(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the unpadded elements held by ``rank`` (may be empty)."""
    s = math.ceil(numel / world_size)
    return min(rank * s, numel), min((rank + 1) * s, numel)


class GatherHandle:
    """One coalesced all-gather of partitioned parameters; :meth:`wait` makes them AVAILABLE.

    Waiting twice is harmless. Parameters that were already being gathered by an earlier handle
    are waited for through that handle.
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        work: Any,
        output: torch.Tensor | None,
        world_size: int,
        depends: Sequence[GatherHandle] = (),
        on_done: Any = None,
        side: SideStream | None = None,
        decode: Any = None,
    ) -> None:
        self.params = list(params)
        self._decode = decode  # ZeRO++: raw output -> a plain gather's rows (_zeropp.py)
        self.hooked = False  # a stage 3 hooks' gather under ZeRO++ (hpZ keeps a secondary)
        self._work, self._output, self._world = work, output, world_size
        self._depends = list(depends)
        self._on_done = on_done
        self._side = side  # the side stream the all-gather was queued on
        self.done = False

    def wait(self) -> None:
        """Complete the collective and point every parameter's ``data`` at its whole value."""
        for other in self._depends:
            other.wait()
        if self.done:
            return
        self.done = True
        if self._work is not None:
            self._work.wait()
        if self._side is not None:
            self._side.join()  # the compute stream reads what the side stream gathered
        if self.params:
            output = self._output
            if self._decode is not None and output is not None:
                output = self._decode(output)
            _unpack(self.params, output, self._world)
        for p in self.params:
            p.ds_status = ZeroParamStatus.AVAILABLE
        self._output = self._work = None
        if self._on_done is not None:
            self._on_done(self)


def _flat_shards(params: Sequence[torch.nn.Parameter], device: torch.device) -> torch.Tensor:
    """This rank's shards of ``params`` on ``device``, concatenated (no copy for one on it)."""
    shards = [p.ds_tensor.to(device, non_blocking=True) for p in params]
    return shards[0] if len(shards) == 1 else torch.cat(shards)


def _unpack(params: Sequence[torch.nn.Parameter], output: torch.Tensor | None, world: int) -> None:
    """Point each parameter's ``data`` at its whole value: in its whole buffer (filled from the
    coalesced ``output`` here, or by the collective itself when ``output`` is None), else in a
    fresh tensor (persistent parameters)."""
    columns = output.view(world, -1) if output is not None else None
    offset = 0
    for p in params:
        s = p.ds_tensor.numel()
        buffer: torch.Tensor | None = getattr(p, "_ds_buffer", None)
        if columns is not None:
            piece = columns.narrow(1, offset, s)
            if buffer is not None:
                buffer.view(world, s).copy_(piece)
                full = buffer
            else:
                full = piece.reshape(-1)  # copies: rows are strided
            offset += s
        else:
            assert buffer is not None
            full = buffer
        p.data = full.narrow(0, 0, p.ds_numel).view(p.ds_shape)


class ParamPartitioner:
    """Owns the partitioned parameters of one data-parallel group (see [Note: partitioned
    parameters]).

    Args:
        group: the data-parallel process group (None: the default group, or one process when
            ``torch.distributed`` is not initialised).
        persistence_threshold: parameters of at most this many elements stay whole.
        offload: ``offload_param``: where shards live (None: on the compute device).
        shard_store: the store behind ``offload.device == "nvme"``.
        compute_device: where gathered parameters live and, without ``offload``, the shards
            (None: each parameter's own device). ``ds_zero.Init`` passes the accelerator's
            current device, so a model is partitioned straight onto it.

    Example:
        >>> partitioner = ParamPartitioner(dp_group, persistence_threshold=0)
        >>> partitioner.partition(model.parameters())
        >>> partitioner.gather(list(model.parameters())).wait()  # whole again
        >>> partitioner.release(list(model.parameters()))  # p.data empty again
    """

    def __init__(
        self,
        group: Any = None,
        *,
        persistence_threshold: int = 100_000,
        offload: OffloadParamConfig | None = None,
        shard_store: ShardStore | None = None,
        compute_device: torch.device | None = None,
    ) -> None:
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.rank, self.world_size = ds_comm.get_rank(group), ds_comm.get_world_size(group)
        elif group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        else:
            self.rank, self.world_size = 0, 1
        self.persistence_threshold = persistence_threshold
        self._offload = offload
        self._children: dict[int, ParamPartitioner] = {}  # by id of their group
        self.offload_device = offload.device if offload is not None else "none"
        self.pin_memory = bool(offload.pin_memory) if offload is not None else False
        if self.offload_device == "nvme" and shard_store is None:
            raise ValueError(
                'offload_param.device = "nvme" needs a shard_store (ds_zero\'s NVMe parameter '
                "store); pass shard_store="
            )
        self.shard_store = shard_store if self.offload_device == "nvme" else None
        self.compute_device = torch.device(compute_device) if compute_device is not None else None
        self.params: list[torch.nn.Parameter] = []  # in partitioning order
        self._inflight: dict[int, GatherHandle] = {}
        self._sides: dict[torch.device, SideStream] = {}
        self.gathered_numel = 0  # elements of non-persistent parameters AVAILABLE or INFLIGHT
        self.peak_gathered_numel = 0
        # ZeRO++ qwZ/hpZ for the stage 3 hooks' gathers (set by Stage3Optimizer; _zeropp.py)
        self.weight_comm: WeightComm | None = None

    # --- partitioning ----------------------------------------------------------------------------

    def _device_of(self, p: torch.Tensor) -> torch.device:
        return self.compute_device if self.compute_device is not None else p.device

    def shard_device(self, p: torch.Tensor) -> torch.device:
        """Where ``p``'s shard lives: host memory with ``offload_param`` (``"cpu"``, and
        ``"nvme"`` between reads), else the compute device (see [Note: partitioned
        parameters])."""
        if self.offload_device in ("cpu", "nvme"):
            return torch.device("cpu")
        return self._device_of(p)

    def _pinned_shards(self) -> bool:
        return self.offload_device in ("cpu", "nvme") and self.pin_memory and _can_pin()

    def partition(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        names: Sequence[str] | None = None,
        broadcast_from: int | None = None,
    ) -> None:
        """Partition every parameter not partitioned yet (idempotent).

        Args:
            params: the parameters (whole, identical on every rank unless ``broadcast_from``).
            names: their names (stored as ``p.ds_name``, for messages).
            broadcast_from: group rank whose values every rank takes first (None: no broadcast).
        """
        params = list(params)
        name_of = dict(zip(map(id, params), names)) if names is not None else {}
        seen: set[int] = set()
        todo = []
        for p in params:
            if id(p) in seen or is_partitioned(p):
                continue
            seen.add(id(p))
            todo.append(p)
        if broadcast_from is not None and self.world_size > 1:
            src = broadcast_from
            if self.group is not None:
                src = dist.get_global_rank(self.group, broadcast_from)
            with torch.no_grad():
                for p in todo:
                    # the group's collectives take tensors on the compute device (NCCL)
                    if p.device != self._device_of(p):
                        p.data = p.data.to(self._device_of(p))
                    ds_comm.broadcast(p.data, src, group=self.group)
        for p in todo:
            self._partition_one(p, name_of.get(id(p)))

    def _partition_one(self, p: torch.nn.Parameter, name: str | None) -> None:
        numel, world = p.numel(), self.world_size
        s = math.ceil(numel / world) if numel else 0
        start, stop = shard_bounds(numel, world, self.rank)
        shard = torch.empty(
            s, dtype=p.dtype, device=self.shard_device(p), pin_memory=self._pinned_shards()
        )
        with torch.no_grad():
            shard.narrow(0, 0, stop - start).copy_(p.data.reshape(-1)[start:stop])
            shard.narrow(0, stop - start, s - (stop - start)).zero_()
        p.ds_id = next(_DS_IDS)
        p.ds_shape = tuple(p.shape)
        p.ds_numel = numel
        p.ds_name = name
        p.ds_persist = numel <= self.persistence_threshold
        p.ds_tensor = shard
        p.ds_process_group = self.group
        p.ds_partitioner = self
        p.ds_active_sub_modules = set()
        p.partition_numel = lambda s=s: s
        p.padding_size = lambda pad=s * world - numel: pad
        p.all_gather = lambda param_list=None, p=p: self.gather(param_list or [p]).wait()
        p.partition = lambda param_list=None, p=p: self.release(param_list or [p])
        if p.ds_persist:
            if p.device != self._device_of(p):
                p.data = p.data.to(self._device_of(p))
            p.ds_status = ZeroParamStatus.AVAILABLE
        else:
            p.data = torch.empty(0, dtype=p.dtype, device=self._device_of(p))
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE
        self.params.append(p)
        if self.shard_store is not None:
            self.shard_store.evict([p])

    def apply_persistence_threshold(self, threshold: int) -> None:
        """Make parameters of at most ``threshold`` elements persistent: gathered now, whole on
        every rank from then on. A collective: every rank of the group calls it.

        DeepSpeed marks persistence when the ZeRO-3 engine takes a model partitioned by
        ``zero.Init`` (whose threshold clients such as transformers only resolve from
        ``"auto"`` after the model exists), so ``ds_zero.Init`` partitions everything and the
        engine applies its config's threshold here.
        """
        self.persistence_threshold = threshold
        newly = [p for p in self.params if not p.ds_persist and p.ds_numel <= threshold]
        if not newly:
            return
        self.gather(newly).wait()
        for p in newly:
            p.ds_persist = True
            self.gathered_numel -= p.ds_numel  # the count covers non-persistent ones only

    def sub_partitioner(self, group: Any) -> ParamPartitioner:
        """The partitioner of parameters sharded over ``group``, a subgroup of this one's (MoE
        experts over their expert-data-parallel group), created on first use; see [Note:
        parameters on their own group]."""
        child = self._children.get(id(group))
        if child is None:
            child = ParamPartitioner(
                group,
                persistence_threshold=self.persistence_threshold,
                offload=self._offload,
                shard_store=self.shard_store,
                compute_device=self.compute_device,
            )
            if self.world_size % child.world_size:
                raise ValueError(
                    f"a parameter group's process group has {child.world_size} ranks, which "
                    f"does not divide the data-parallel size {self.world_size}; it must be a "
                    "subgroup of the data-parallel group"
                )
            self._children[id(group)] = child
        return child

    def live_numel(self) -> int:
        """Elements of non-persistent parameters gathered now, this partitioner's and its
        subgroups' (what ``stage3_max_live_parameters`` caps)."""
        return self.gathered_numel + sum(c.live_numel() for c in self._children.values())

    def owns(self, p: torch.Tensor) -> bool:
        """True when ``p`` was partitioned by this partitioner or one of its subgroups'."""
        owner = getattr(p, "ds_partitioner", None)
        return owner is self or any(owner is c for c in self._children.values())

    def _split(
        self, params: Iterable[torch.nn.Parameter]
    ) -> tuple[list[torch.nn.Parameter], list[tuple[ParamPartitioner, list[torch.nn.Parameter]]]]:
        """``params`` of this partitioner, and those of each subgroup partitioner."""
        params = list(params)
        if not self._children:
            return params, []
        own: list[torch.nn.Parameter] = []
        theirs: dict[int, list[torch.nn.Parameter]] = {}
        for p in params:
            owner = getattr(p, "ds_partitioner", self)
            if owner is self:
                own.append(p)
            else:
                theirs.setdefault(id(owner), []).append(p)
        children = {id(c): c for c in self._children.values()}
        return own, [(children[k], v) for k, v in theirs.items() if k in children]

    # --- gathering and releasing -----------------------------------------------------------------

    def gather(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        async_op: bool = False,
        phase: Literal["forward", "backward"] | None = None,
    ) -> GatherHandle:
        """All-gather the whole values of ``params`` in one collective (see [Note: partitioned
        parameters]); AVAILABLE and persistent parameters are skipped.

        Every rank of the group must call it with the same parameters in the same order.
        ``phase`` marks the stage 3 hooks' gathers, which ZeRO++ may quantize (qwZ) or take
        from the secondary partition in backward (hpZ); None is an exact gather (see
        ``_zeropp.py``'s [Note: ZeRO++]).

        Returns:
            A handle; the parameters are AVAILABLE after its ``wait()`` (already done unless
            ``async_op``).
        """
        todo: list[torch.nn.Parameter] = []
        params, others = self._split(params)  # [Note: parameters on their own group]
        depends = [child.gather(theirs, async_op=True) for child, theirs in others]
        seen: set[int] = set()
        for p in params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p.ds_status is ZeroParamStatus.INFLIGHT:
                handle = self._inflight.get(p.ds_id)
                if handle is not None and handle not in depends:
                    depends.append(handle)
            elif p.ds_status is ZeroParamStatus.NOT_AVAILABLE:
                todo.append(p)
        if not todo:
            handle = GatherHandle([], None, None, self.world_size, depends)
            if not async_op:
                handle.wait()
            return handle
        if self.shard_store is not None:
            self.shard_store.fetch(todo)
        device = self._device_of(todo[0])
        for p in todo:
            self._grow_buffer(p, device)
        comm = self.weight_comm if phase is not None and self.world_size > 1 else None
        direct: torch.Tensor | None = getattr(todo[0], "_ds_buffer", None)
        direct = direct if len(todo) == 1 and comm is None else None
        output: torch.Tensor | None = None
        decode = None
        numel = sum(p.ds_tensor.numel() for p in todo)
        if direct is None and self.world_size > 1 and comm is None:  # on the compute stream
            output = torch.empty(
                numel * self.world_size, dtype=todo[0].ds_tensor.dtype, device=device
            )
        # A prefetch (async) is queued on the side stream (see _streams.py's [Note: side
        # streams for overlap]); the handle's wait() joins it before the values are read.
        side = self._side_stream(device) if async_op and self.world_size > 1 else None
        with side.use() if side is not None else contextlib.nullcontext():
            if comm is not None:
                work, output, decode = comm.issue(
                    todo,
                    lambda: _flat_shards(todo, device),
                    backward=phase == "backward",
                    device=device,
                )
            elif direct is not None:  # straight into the whole buffer
                flat = _flat_shards(todo, device)
                if self.world_size == 1:
                    direct.copy_(flat)
                    work = None
                else:
                    work = ds_comm.all_gather_into_tensor(
                        direct, flat, group=self.group, async_op=True
                    )
            elif self.world_size == 1:
                flat = _flat_shards(todo, device)
                output, work = flat.clone() if flat is todo[0].ds_tensor else flat, None
            else:
                assert output is not None
                flat = _flat_shards(todo, device)
                work = ds_comm.all_gather_into_tensor(output, flat, group=self.group, async_op=True)
            if side is not None:
                for t in (direct, output):
                    if t is not None:
                        side.record(t)
        if self.shard_store is not None:
            # [Note: partitioned parameters]: the store may drop host copies once sent.
            if work is not None:
                work.wait()
                work = None
            self.shard_store.evict(todo)
        for p in todo:
            p.ds_status = ZeroParamStatus.INFLIGHT
        self.gathered_numel += sum(p.ds_numel for p in todo)
        self.peak_gathered_numel = max(self.peak_gathered_numel, self.gathered_numel)
        handle = GatherHandle(
            todo, work, output, self.world_size, depends, self._done, side, decode=decode
        )
        handle.hooked = comm is not None
        for p in todo:
            self._inflight[p.ds_id] = handle
        if not async_op:
            handle.wait()
        return handle

    def _side_stream(self, device: torch.device) -> SideStream:
        side = self._sides.get(device)
        if side is None:
            side = self._sides[device] = SideStream(device, enabled=True)
        return side

    def _grow_buffer(self, p: torch.nn.Parameter, device: torch.device) -> None:
        """Give a non-persistent ``p`` its whole buffer: the one kept by a storage-freeing
        release, re-grown, else a new one (see [Note: freeing gathered storage])."""
        if p.ds_persist:
            return
        buffer: torch.Tensor | None = getattr(p, "_ds_buffer", None)
        if buffer is None or buffer.device != device:
            p._ds_buffer = torch.empty(
                p.ds_tensor.numel() * self.world_size, dtype=p.dtype, device=device
            )
            return
        storage = buffer.untyped_storage()
        if storage.nbytes() < buffer.nbytes:
            storage.resize_(buffer.nbytes)

    def _done(self, handle: GatherHandle) -> None:
        if handle.hooked and self.weight_comm is not None:
            self.weight_comm.keep_secondary(handle.params)  # hpZ, after a hooks' gather
        for p in handle.params:
            if self._inflight.get(p.ds_id) is handle:
                del self._inflight[p.ds_id]

    def release(self, params: Iterable[torch.nn.Parameter], *, free_storage: bool = False) -> None:
        """Free the whole value of non-persistent parameters (``p.data`` becomes empty).

        A parameter still being gathered is waited for first (its collective is in flight on
        every rank and must complete).

        Args:
            params: the parameters.
            free_storage: also free the whole value's storage now, even where autograd keeps
                views of it, and keep the buffer for the next gather to refill (the stage 3
                hooks; see [Note: freeing gathered storage]). False: only drop the reference
                (tensors handed out earlier stay valid).
        """
        params, others = self._split(params)
        for child, theirs in others:
            child.release(theirs, free_storage=free_storage)
        for p in params:
            if p.ds_persist:
                continue
            if p.ds_status is ZeroParamStatus.INFLIGHT:
                self._inflight[p.ds_id].wait()
            if p.ds_status is ZeroParamStatus.AVAILABLE:
                p.data = torch.empty(0, dtype=p.dtype, device=p.data.device)
                p.ds_status = ZeroParamStatus.NOT_AVAILABLE
                self.gathered_numel -= p.ds_numel
                buffer: torch.Tensor | None = getattr(p, "_ds_buffer", None)
                if buffer is not None and free_storage:
                    buffer.untyped_storage().resize_(0)
                elif buffer is not None:
                    p._ds_buffer = None

    def release_all(self) -> None:
        """Release every non-persistent parameter of this partitioner (and its subgroups')."""
        self.release(self.params)
        for child in self._children.values():
            child.release_all()

    # --- writing shards --------------------------------------------------------------------------

    def write_shard_from_full(self, p: torch.nn.Parameter) -> None:
        """Copy this rank's slice of the whole ``p.data`` into ``p.ds_tensor`` (after the whole
        value was changed, e.g. by ``GatheredParameters`` with a ``modifier_rank``)."""
        if p.ds_status is not ZeroParamStatus.AVAILABLE:
            raise ValueError(
                f"parameter {p.ds_name or p.ds_id} is {p.ds_status.name}: gather it before "
                "writing its shard from the whole value"
            )
        start, stop = shard_bounds(p.ds_numel, self.world_size, self.rank)
        if self.shard_store is not None:
            self.shard_store.fetch([p])
        with torch.no_grad():
            shard = p.ds_tensor
            shard.narrow(0, 0, stop - start).copy_(p.data.reshape(-1)[start:stop])
            shard.narrow(0, stop - start, shard.numel() - (stop - start)).zero_()
        if self.shard_store is not None:
            self.shard_store.evict([p])
        p.ds_secondary_tensor = None  # hpZ's copy of the old value

    def drop_secondary(self) -> None:
        """Forget ZeRO++ hpZ's secondary partition (the shards changed: an optimizer step, a
        load); the next forward gathers over the whole group again."""
        for p in self.params:
            p.ds_secondary_tensor = None

    def write_full_from_shards(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Refresh the whole value of persistent (and AVAILABLE) parameters from every rank's
        shard, after the shards were updated (an optimizer step)."""
        params, others = self._split(params)
        for child, theirs in others:
            child.write_full_from_shards(theirs)
        whole = [p for p in params if p.ds_status is ZeroParamStatus.AVAILABLE]
        if not whole:
            return
        for p in whole:
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE
            if not p.ds_persist:
                self.gathered_numel -= p.ds_numel
        self.gather(whole).wait()
        for p in whole:
            if p.ds_persist:
                self.gathered_numel -= p.ds_numel

    def shard_nbytes(self) -> int:
        """Bytes this rank holds for its parameters: every shard plus the whole persistent ones."""
        own = sum(p.ds_tensor.nbytes + (p.data.nbytes if p.ds_persist else 0) for p in self.params)
        return own + sum(c.shard_nbytes() for c in self._children.values())
