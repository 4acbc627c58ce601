"""Gradient reduction: hooks on gradient accumulation launch one collective per unit of the flat
layout as soon as its gradients are complete, and land the result where the stage keeps it.

[Note: where gradients live]
- Stages 0 and 1 keep every gradient in one flat buffer per group (``full``), of the model's
  dtype, and each ``p.grad`` is a view into it (DDP's ``gradient_as_bucket_view``), so autograd
  accumulates micro-batches in place and a unit is reduced straight from the buffer. Stage 0
  all-reduces it; stage 1 reduce-scatters and writes the reduced shard back into its own slice
  of ``full``, where the step reads it (DeepSpeed's stage 1 holds the full gradients too).
- Stage 2 keeps only this rank's shard (``part``). A gradient is copied into a staging buffer
  the moment autograd finishes it and ``p.grad`` is freed (``contiguous_gradients``; otherwise it
  stays until its unit is reduced and is then flattened into a fresh buffer); the staged unit is
  reduce-scattered and the shard accumulated into ``part``. No rank holds more than a few
  units' worth of full gradients at any time.
- Under ``offload_optimizer``, ``part`` is an fp32 host tensor for stages 1 and 2 (the
  optimizer reads it there); stage 1 copies its reduced shard there instead of into ``full``.
- Where every group is reduced over one rank there is nothing to reduce or shard, so stage 2
  keeps no staging buffers: it holds its gradients as stage 1 does (``p.grad`` views into
  ``full``) or, under ``offload_optimizer``, copies each gradient into its slice of the host
  ``part`` the moment autograd finishes it (``_land_direct``). A one-GPU run thus holds one
  low-precision gradient copy, not three (``part``, and two staging buffers of
  ``reduce_bucket_size`` elements).
- On an accelerator, a low-precision ``full``/``part`` is freed once the step has taken its
  fp32 copy (``release_low_precision``) and allocated again by ``zero()``: the optimizer step
  then holds one gradient copy (fp32), as DeepSpeed's does. On one rank the buffer comes back
  only at the end of the next backward (``finish``), where the gradients autograd left in
  ``p.grad`` are moved into it: the start of backward, where the activations peak, holds no
  gradient buffer, as DeepSpeed's does not. The caching allocator makes the round trip free;
  on the host it would page-fault every step, so there it is off unless asked for
  (``release_between_steps``).

[Note: when gradients are reduced]
DeepSpeed's rule: stage 2 reduces in every micro-batch's backward and accumulates into the
shard; stages 0 and 1 let micro-batches accumulate locally and reduce only in the backward of
the accumulation boundary. Units are launched in one fixed order (``FlatUnit.order``, the order
their gradients normally complete in) on every rank, as collectives must be; a unit that is
complete early waits for the ones before it. Units whose parameters got no gradient are launched
at the end of backward with zeros for the missing gradients (``ignore_unused_parameters``).

[Note: overlapping reductions with backward]
With ``overlap_comm`` a unit's collective is issued asynchronously and backward continues; the
work is waited for when its staging buffer is needed again or at the end of backward, and only
then is its result accumulated. The copy-in, the collective and the accumulation run on the
side stream of the :class:`~ds_zero._streams.CollectiveQueue` shared with stage 3 (see
``_streams.py``'s [Note: side streams for overlap]). On gloo the async work handle is the
overlap. Without ``overlap_comm`` each collective is waited for in the hook that launched it.

[Note: scaling and casting around the collective]
A unit is divided by ``predivide`` before it is summed and the sum multiplied by
``predivide / world_size`` after it, so the result is always the average. ``predivide`` defaults
to the world size (no post-scaling; exact for powers of two, and fp16 sums cannot overflow
where the average would not); DeepSpeed's ``gradient_predivide_factor`` sets it. With a
``communication dtype`` other than the gradients', the divided unit is cast to it, the
collective runs on the cast copy, and the result is scaled there and cast back where the stage
keeps gradients (the division runs before the cast, in the wider dtype when there is one). On
one rank nothing is communicated, so nothing is scaled or cast.

[Note: param groups with their own process group]
A group may be reduced and sharded over its own process group (``group_contexts``; MoE expert
parameters over their expert-data-parallel group, as DeepSpeed's ``real_dp_process_group``).
Its gradients are still divided by the size of the data-parallel group (``ctx``), so every
gradient is that of the mean loss over the whole data-parallel batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import ds_comm
from ds_comm.accelerator import get_accelerator
from ds_zero._layout import FlatGroup, FlatUnit
from ds_zero._offload import host_zeros
from ds_zero._streams import CollectiveQueue
from ds_zero.api import ZeroConfig

__all__ = ["GradReducer", "ReduceContext"]


@dataclass(frozen=True)
class ReduceContext:
    """Where the reduction runs: the data-parallel group and where gradient shards live.

    Attributes:
        group: data-parallel process group (None: the default group).
        rank: this rank's index in ``group``.
        world_size: ranks in ``group``.
        offload: gradient shards live in host memory as fp32 (``offload_optimizer``).
        pin_memory: allocate them page-locked (only meaningful with CUDA).
    """

    group: Any
    rank: int
    world_size: int
    offload: bool = False
    pin_memory: bool = False


class _StagingPool:
    """Reusable flat buffers of the largest unit's size (stage 2 with contiguous gradients)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.numel, self.dtype, self.device = numel, dtype, device
        self.free: list[torch.Tensor] = []
        self._bases: dict[tuple[int, int], torch.Tensor] = {}
        self.allocated = 0

    def take(self, numel: int) -> torch.Tensor:
        """A buffer's first ``numel`` elements (a view; :meth:`give` it back)."""
        if not self.free:
            self.allocated += 1
            self.free.append(torch.empty(self.numel, dtype=self.dtype, device=self.device))
        base = self.free.pop()
        self._bases[base.narrow(0, 0, numel).data_ptr(), numel] = base
        return base.narrow(0, 0, numel)

    def give(self, view: torch.Tensor) -> None:
        self.free.append(self._bases.pop((view.data_ptr(), view.numel())))

    @property
    def nbytes(self) -> int:
        return self.allocated * self.numel * self.dtype.itemsize


class GradReducer:
    """Owns gradient storage and reduces gradients into it (see [Note: where gradients live]).

    Args:
        groups: the flat layout.
        config: the ``zero_optimization`` section (stage flags, buckets, overlap).
        ctx: the data-parallel group and host placement.
        group_contexts: per group, the process group it is reduced and sharded over (default
            ``ctx`` for all); see [Note: param groups with their own process group].
        predivide_factor: divide gradients by this before the sum and the sum by
            ``world_size / predivide_factor`` after it (None: the world size, all before); see
            [Note: scaling and casting around the collective].
        comm_dtype: dtype the collectives run in (None: the gradients' dtype).
        release_between_steps: free low-precision gradient buffers once the step has its fp32
            copy (None: on accelerators only); see [Note: where gradients live].
    """

    def __init__(
        self,
        groups: Sequence[FlatGroup],
        config: ZeroConfig,
        ctx: ReduceContext,
        group_contexts: Sequence[ReduceContext] | None = None,
        *,
        predivide_factor: float | None = None,
        comm_dtype: torch.dtype | None = None,
        release_between_steps: bool | None = None,
    ):
        self.groups = list(groups)
        self.config = config
        self.ctx = ctx
        self.contexts = list(group_contexts) if group_contexts else [ctx] * len(self.groups)
        local = all(c.world_size == 1 for c in self.contexts)
        # Stage 2 on one rank: nothing to shard (see [Note: where gradients live]).
        self._shard = bool(config.shard_gradients) and not (local and not ctx.offload)
        self._direct = self._shard and local  # offload on one rank: land each gradient
        self._nothing_to_reduce = local and not ctx.offload
        self._landed: set[tuple[int, int]] = set()  # (unit order, index) landed this window
        self._stale_part = False  # direct landing: slices not landed this window hold old values
        self._landed_now: set[tuple[int, int]] = set()  # ... in this backward
        self.units = sorted((u for g in self.groups for u in g.units), key=lambda u: u.order)
        self._where: dict[torch.Tensor, tuple[FlatUnit, int]] = {
            p: (u, i) for u in self.units for i, p in enumerate(u.params)
        }
        ref = self.groups[0].flat
        self.dtype, self.device = ref.dtype, ref.device
        if release_between_steps is None:
            release_between_steps = self.device.type != "cpu"
        self.release_between_steps = release_between_steps
        world = ctx.world_size
        same = world == 1 or comm_dtype in (None, self.dtype)
        self.queue = CollectiveQueue(
            self.device,
            overlap=bool(config.overlap_comm),
            world_size=world,
            predivide_factor=predivide_factor,
            comm_dtype=None if same else comm_dtype,
        )
        self.full: list[torch.Tensor | None] = [None] * len(self.groups)
        self.part: list[torch.Tensor | None] = [None] * len(self.groups)
        self._allocate()
        self._staging: _StagingPool | None = None
        if self._shard and config.contiguous_gradients and not self._direct:
            largest = max(u.padded_numel for u in self.units)
            self._staging = _StagingPool(largest, self.dtype, self.device)
        self._staged: dict[int, torch.Tensor] = {}  # unit order -> staging buffer
        self._arrived: dict[int, list[bool]] = {}
        self._accumulated = [False] * len(self.units)
        self._pending = [0] * len(self.units)
        self._next = 0
        self._armed = False
        self._reducing = False
        self.unreduced = False  # local gradients accumulated since the last reduction
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self._where
        ]

    # --- storage ---------------------------------------------------------------------------------

    def _allocate(self) -> None:
        for g, group in enumerate(self.groups):
            if not self._shard:
                self.full[g] = torch.zeros_like(group.flat)
            if self.ctx.offload:
                pin = self.ctx.pin_memory
                self.part[g] = host_zeros(group.partition_numel, torch.float32, pin_memory=pin)
            elif self._shard:
                self.part[g] = torch.zeros(
                    group.partition_numel, dtype=self.dtype, device=self.device
                )
        self._released: list[int] = []
        self._alias_grads()

    def release_low_precision(self) -> None:
        """Free the device gradient buffers of a dtype other than fp32: the step has taken
        its fp32 copy of them (see [Note: where gradients live]); ``zero()`` (or the next
        backward) allocates them again. A no-op unless ``release_between_steps``."""
        if not self.release_between_steps or self.dtype == torch.float32:
            return
        self.wait_all()
        for g in range(len(self.groups)):
            device_part = self.part[g] is not None and not self.ctx.offload
            if self.full[g] is None and not device_part:
                continue
            self.full[g] = None
            if device_part:
                self.part[g] = None
            self._released.append(g)
        for p in self._where:
            p.grad = None  # views into the freed buffers

    @property
    def _lazy(self) -> bool:
        """Whether freed buffers come back only at the end of the next backward (one rank)."""
        return self._nothing_to_reduce and self.release_between_steps

    def ensure_allocated(self) -> None:
        """Bring back freed buffers now (a reader of gradients between steps), holding any
        gradients autograd left in ``p.grad``, and zero what no gradient landed in yet."""
        if self._released:
            self._reallocate()
            self._alias_grads()
        self.settle()

    def settle(self) -> None:
        """Direct landing: zero the host slices that no gradient landed in yet this window (see
        :meth:`zero`); the landed ones were overwritten by their first landing."""
        if not self._stale_part:
            return
        for p, (unit, index) in self._where.items():
            if (unit.order, index) not in self._landed:
                part = self.part[unit.group]
                assert part is not None
                unit.in_partition(part).narrow(0, unit.offsets[index], p.numel()).zero_()
        self._stale_part = False

    def _reallocate(self) -> None:
        """Allocate (zeroed) what :meth:`release_low_precision` freed."""
        for g in self._released:
            group = self.groups[g]
            if not self._shard:
                self.full[g] = torch.zeros_like(group.flat)
            elif not self.ctx.offload:
                self.part[g] = torch.zeros(
                    group.partition_numel, dtype=self.dtype, device=self.device
                )
        self._released = []

    def _alias_grads(self) -> None:
        """Point every ``p.grad`` at its view of ``full`` (stages 0/1), or clear it (stage 2).

        A gradient someone else replaced (``model.zero_grad()`` sets None) is taken over: its
        view is zeroed, or filled with the replacement, so autograd accumulates into ``full``.
        """
        for unit in self.units:
            full = self.full[unit.group]
            for i, p in enumerate(unit.params):
                if full is None:
                    p.grad = None
                    continue
                view, grad = unit.param_view(full, i), p.grad
                if grad is not None and grad.data_ptr() == view.data_ptr():
                    continue
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad)
                p.grad = view

    def zero(self) -> None:
        """Zero every gradient (the start of a new accumulation window).

        Direct landing (one rank under offload) zeroes no host shard here: a gradient's first
        landing in a window overwrites its slice, and the end of each backward (or a reader,
        through :meth:`ensure_allocated`) zeroes the slices nothing landed in. Zeroing the whole
        fp32 shard was a pass over 4 bytes per parameter of host memory every step (0.13 s of
        a 1B model's 3.1 s offloaded step on an H200 host).
        """
        self.wait_all()
        released = set(self._released)
        for g, (full, part) in enumerate(zip(self.full, self.part)):
            for t in (full, part):
                if t is not None and g not in released and not (self._direct and t is part):
                    t.zero_()
        self._stale_part = self._direct
        if not self._lazy:
            self._reallocate()
        self._accumulated = [False] * len(self.units)
        self._landed.clear()
        self.unreduced = False
        self._alias_grads()

    def nbytes(self) -> tuple[int, int, int]:
        """``(gradient bytes, of which in host memory, staging buffer bytes)``."""
        grads = sum(t.nbytes for t in (*self.full, *self.part) if t is not None)
        host = sum(t.nbytes for t in self.part if t is not None) if self.ctx.offload else 0
        if self._shard and not self.config.contiguous_gradients:
            grads += sum(p.grad.nbytes for p in self._where if p.grad is not None)
        return grads, host, self._staging.nbytes if self._staging is not None else 0

    @property
    def in_flight(self) -> int:
        """Collectives launched and not yet waited for (non-zero only with ``overlap_comm``)."""
        return len(self.queue)

    # --- a backward pass -------------------------------------------------------------------------

    def begin(self, reduce: bool) -> None:
        """Arm the hooks for one backward; ``reduce`` says whether this pass completes the
        accumulation window (stage 2 reduces in every pass)."""
        reduce = reduce or self._shard
        self._armed, self._reducing = True, reduce
        self._next = 0
        self._landed_now.clear()
        if self._released and not self._lazy:  # a step that raised before zero()
            self._reallocate()
        if not self._shard:
            self._alias_grads()
        if reduce:
            self._pending = [len(u.params) for u in self.units]
            self._arrived = {}
        else:
            self.unreduced = True

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._armed:
            raise RuntimeError(
                "a ZeRO-managed parameter received a gradient outside ZeroOptimizer.backward(); "
                "call zero_optimizer.backward(loss) instead of loss.backward()"
            )
        if not self._reducing:
            return
        unit, index = self._where[p]
        if unit.order < self._next:
            raise RuntimeError(
                f"parameter {tuple(p.shape)} got a gradient after its bucket was reduced in this "
                "backward; ZeRO needs one backward per micro-batch (no retain_graph re-runs)"
            )
        if self._direct:
            self._land_direct(unit, index, p)
            return
        if self._nothing_to_reduce:
            return  # one rank: the gradient stays where autograd put it
        if self._shard and self._staging is not None:
            with self.queue.side.use():
                self._stage(unit, index, p)
        self._pending[unit.order] -= 1
        while self._next < len(self.units) and self._pending[self._next] == 0:
            self._launch(self.units[self._next])
            self._next += 1

    def _land_direct(self, unit: FlatUnit, index: int, p: torch.Tensor) -> None:
        """One rank under offload: copy ``p.grad`` into its slice of the host ``part`` and free
        it. The copy is queued on the compute stream, so the freed gradient's memory is reused
        only after it; ``wait_all`` synchronizes before the optimizer reads ``part``."""
        part = self.part[unit.group]
        grad = p.grad
        assert part is not None and grad is not None
        target = unit.in_partition(part).narrow(0, unit.offsets[index], p.numel())
        key = (unit.order, index)
        if key in self._landed:  # a later micro-batch of the window: accumulate
            target.add_(grad.reshape(-1).to(device=target.device, dtype=target.dtype))
        else:
            target.copy_(grad.reshape(-1), non_blocking=target.is_pinned())
            self._landed.add(key)
        self._landed_now.add(key)
        p.grad = None

    def _stage(self, unit: FlatUnit, index: int, p: torch.Tensor) -> None:
        """Copy ``p.grad`` into its unit's staging buffer and free it (contiguous gradients)."""
        buffer = self._staged.get(unit.order)
        if buffer is None:
            buffer = self._staged[unit.order] = self._take_staging(unit)
            self._arrived[unit.order] = [False] * len(unit.params)
        grad = p.grad
        assert grad is not None
        buffer.narrow(0, unit.offsets[index], p.numel()).copy_(grad.reshape(-1))
        self.queue.side.record(grad)
        self._arrived[unit.order][index] = True
        p.grad = None

    def _take_staging(self, unit: FlatUnit) -> torch.Tensor:
        assert self._staging is not None
        while not self._staging.free and len(self.queue) and self._staging.allocated >= 2:
            self.queue.wait_oldest()  # double buffering, as DeepSpeed's two ipg buffers
        buffer = self._staging.take(unit.padded_numel)
        buffer.narrow(0, unit.numel, unit.padded_numel - unit.numel).zero_()
        return buffer

    def finish(self) -> None:
        """End of backward: launch what is left (unused parameters), wait for everything."""
        if not self._armed:
            return
        try:
            if self._direct:
                self._check_unused(
                    [p for p, (u, i) in self._where.items() if (u.order, i) not in self._landed_now]
                )
            elif self._reducing and not self._nothing_to_reduce:
                self._launch_leftovers()
            self.wait_all()
            self.ensure_allocated()  # one rank after a step: the gradients move in now
            if self._reducing:
                self.unreduced = False
        finally:
            self._armed = self._reducing = False

    def abort(self) -> None:
        """Backward raised: drop this pass's partial state (gradients are zeroed by the caller)."""
        with contextlib.suppress(Exception):
            self.queue.drop()
        for buffer in self._staged.values():
            self._release(buffer)
        self._staged.clear()
        self._armed = self._reducing = False

    def flush(self) -> None:
        """Reduce local gradients that no backward reduced yet (a step off the boundary)."""
        if not self.unreduced:
            return
        self.begin(reduce=True)
        self.finish()

    def _launch_leftovers(self) -> None:
        missing = [
            p
            for u in self.units[self._next :]
            for i, p in enumerate(u.params)
            if self._is_missing(u, i)
        ]
        self._check_unused(missing)
        while self._next < len(self.units):
            self._launch(self.units[self._next])
            self._next += 1

    def _check_unused(self, missing: Sequence[torch.Tensor]) -> None:
        if missing and not self.config.ignore_unused_parameters:
            shapes = [tuple(p.shape) for p in missing[:5]]
            raise RuntimeError(
                f"{len(missing)} parameter(s) got no gradient in this backward (shapes {shapes}"
                "...); set zero_optimization.ignore_unused_parameters to true to reduce them as "
                "zeros, or remove them from the optimizer"
            )

    def _is_missing(self, unit: FlatUnit, index: int) -> bool:
        if not self._shard:
            return False  # the flat buffer holds zeros (or earlier micro-batches) for it
        if self._staging is not None:
            arrived = self._arrived.get(unit.order)
            return arrived is None or not arrived[index]
        return unit.params[index].grad is None

    # --- collectives -----------------------------------------------------------------------------

    def _launch(self, unit: FlatUnit) -> None:
        with self.queue.side.use():
            if self._shard:
                buffer = self._stage_2_input(unit)
                staged = buffer if self._staging is not None else None
            else:
                full = self.full[unit.group]
                assert full is not None
                buffer, staged = unit.full(full), None
            send = self.queue.send_buffer(buffer)
            work, finalize = self._reduce(unit, buffer, send)
        release = None if staged is None else (lambda: self._release(staged))
        self.queue.push(work, finalize, release)

    def _stage_2_input(self, unit: FlatUnit) -> torch.Tensor:
        """The unit's flat gradient, zeros where a parameter got none; frees ``p.grad``."""
        if self._staging is not None:
            buffer = self._staged.pop(unit.order, None)
            if buffer is None:
                buffer = self._take_staging(unit)
                self._arrived[unit.order] = [False] * len(unit.params)
            for i, arrived in enumerate(self._arrived.pop(unit.order)):
                if not arrived:
                    buffer.narrow(0, unit.offsets[i], unit.params[i].numel()).zero_()
            return buffer
        buffer = torch.zeros(unit.padded_numel, dtype=self.dtype, device=self.device)
        for i, p in enumerate(unit.params):
            if p.grad is not None:
                buffer.narrow(0, unit.offsets[i], p.numel()).copy_(p.grad.reshape(-1))
                self.queue.side.record(p.grad)
                p.grad = None
        return buffer

    def _reduce(
        self, unit: FlatUnit, buffer: torch.Tensor, send: torch.Tensor
    ) -> tuple[Any, Callable[[], None] | None]:
        """Issue the unit's collective on ``send`` (``buffer``, or its copy in the communication
        dtype); return its work and the steps that scale and land its result."""
        ctx, cfg = self.contexts[unit.group], self.config
        async_op = bool(cfg.overlap_comm)  # None (unset) is synchronous, as False
        if not cfg.shard_optimizer_state:  # stage 0: the average, in place
            work = self._all_reduce(send, async_op, ctx)
            back = None if send is buffer else (lambda: buffer.copy_(send))
            return work, _chain(self.queue.scale(send), back)
        own = send.view(ctx.world_size, unit.shard_numel)[ctx.rank]
        if ctx.world_size == 1 or not cfg.reduce_scatter:
            work = self._all_reduce(send, async_op, ctx)
            return work, _chain(self.queue.scale(own), self._landing(unit, own))
        part = self.part[unit.group]
        direct = (
            part is not None
            and not self._accumulated[unit.order]
            and part.dtype == send.dtype
            and part.device == send.device
            and self.queue.postscale == 1.0
        )
        if direct:  # first gradient of this window: reduce straight into the shard
            assert part is not None
            out = unit.in_partition(part)
            work = ds_comm.reduce_scatter_tensor(out, send, group=ctx.group, async_op=async_op)
            self._accumulated[unit.order] = True
            return work, None
        out = torch.empty(unit.shard_numel, dtype=send.dtype, device=send.device)
        work = ds_comm.reduce_scatter_tensor(out, send, group=ctx.group, async_op=async_op)
        return work, _chain(self.queue.scale(out), self._landing(unit, out))

    def _all_reduce(self, buffer: torch.Tensor, async_op: bool, ctx: ReduceContext) -> Any:
        if ctx.world_size == 1:
            return None
        return ds_comm.all_reduce(buffer, group=ctx.group, async_op=async_op)

    def _landing(self, unit: FlatUnit, shard: torch.Tensor) -> Callable[[], object] | None:
        """Where a reduced shard goes: ``part`` (accumulating) or the own slice of ``full``."""
        part = self.part[unit.group]
        if part is None:  # stage 1 without offload
            full = self.full[unit.group]
            assert full is not None
            target = unit.shard(full, self.contexts[unit.group].rank)
            if target.data_ptr() == shard.data_ptr():
                return None
            return lambda: target.copy_(shard)
        target = unit.in_partition(part)
        accumulate = self._accumulated[unit.order]
        self._accumulated[unit.order] = True
        if accumulate:
            return lambda: target.add_(shard.to(device=target.device, dtype=target.dtype))
        return lambda: target.copy_(shard, non_blocking=target.is_pinned())

    def _release(self, buffer: torch.Tensor) -> None:
        assert self._staging is not None
        self._staging.give(buffer)

    def wait_all(self) -> None:
        """Wait for every launched collective and land its result."""
        self.queue.wait_all()
        if self.ctx.offload and self.device.type != "cpu":
            get_accelerator().synchronize()  # non-blocking copies into pinned host shards


def _chain(*steps: Callable[[], Any] | None) -> Callable[[], None] | None:
    """One callable running the given steps in order (None when there are none)."""
    todo = [step for step in steps if step is not None]
    if not todo:
        return None

    def run() -> None:
        for step in todo:
            step()

    return run
