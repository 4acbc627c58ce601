"""``FlatLayout``: the layout strategy of stages 0-2 (``ZeroConfig.shard_parameters`` false),
one of the two strategies of the step core (``_core.py``, [Note: one step]).

The step itself is the core's; this layout supplies gradients in flat per-group buckets
(``_reduce.py``), fp32 master partitions, and the write-back that gathers every rank's partition
(``_gather.py``), bracketed by the residency (whole parameters: nothing to do). The master gradient
of a group is the stage 2 / offload shard itself when it is fp32, else a transient fp32 copy (the
own shards of the flat buffer for stage 1, the whole buffer for stage 0); stages 1/2 take the norm
over the group (disjoint shards), stage 0 locally (the whole, identical on every rank after the
reduction).

For stage 0 with fp32 parameters the master *is* the flat parameter buffer and its gradient the
flat gradient buffer (no copies, as plain DDP). Any optimizer whose update is elementwise works
(Adam, AdamW, SGD, Lion, ...); per-tensor rules (LAMB's trust ratio, Adafactor) would see a flat
partition instead of tensors, as in DeepSpeed.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ds_comm
from ds_optim import global_grad_norm
from ds_zero._checkpoint import FORMAT, resolve_states
from ds_zero._gather import gather_partition
from ds_zero._layout import FlatGroup, FlatUnit, build_layout
from ds_zero._offload import (
    StateSwap,
    accepts_fp16_param_groups,
    default_swapper,
    host_zeros,
    upload_cast,
)
from ds_zero._reduce import GradReducer, ReduceContext
from ds_zero._residency import Residency
from ds_zero._setup import dist_rank, dp_rank_and_size, trainable_groups
from ds_zero._shards import ShardLookup, TensorShard
from ds_zero._step_slices import step_in_slices, step_slice_numel
from ds_zero._zero_shards import (
    zero_checkpoint_shards,
    zero_load_checkpoint_shards,
    zero_shard_destinations,
)
from ds_zero.api import MemoryBreakdown, TensorSwapper, ZeroConfig

__all__ = ["FlatLayout"]


class FlatLayout:
    """The flat-bucket layout of stages 0-2 (see the module docstring): what the step core
    (``_core.py``'s [Note: one step]) calls, and this layout's state, checkpoint shards and
    memory. Built by :class:`~ds_zero.ZeroOptimizer`; its arguments are that class's.

    Args:
        model: the module.
        optimizer: the wrapped optimizer (its param groups are re-pointed at the masters).
        config: the ``zero_optimization`` section.
        residency: where parameters live (stages 0-2: whole), bracketing every publish.
        group: the data-parallel process group.
        swapper: the NVMe swapper of the optimizer state (``offload_optimizer.device="nvme"``).
        param_group_process_groups: each param group's own process group (or None).
        gradient_predivide_factor: see :class:`~ds_zero.ZeroOptimizer`.
        comm_dtype: the dtype the gradient collectives run in (None: the gradients').
        norm_group: a further group the squared gradient norm is summed over.
        norm_exclude: parameters another rank of ``norm_group`` counts in the norm.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: ZeroConfig,
        residency: Residency,
        *,
        group: Any,
        swapper: TensorSwapper | None,
        param_group_process_groups: Sequence[Any] | None,
        gradient_predivide_factor: float | None,
        comm_dtype: torch.dtype | None,
        norm_group: Any,
        norm_exclude: Sequence[torch.nn.Parameter],
    ) -> None:
        self.config = config
        offload = self.config.offload_optimizer
        self.module, self.group = model, group
        # Buffers the next checkpoint load takes as its own (see zero_shard_destinations).
        self._load_buffers: list[dict[str, torch.Tensor]] | None = None
        self.optimizer: Any = optimizer  # ds-optim's CPUAdam steps with fp16_param_groups=
        self.residency = residency
        self.rank, self.world_size = dp_rank_and_size(group)
        self.num_shards = self.world_size if self.config.shard_optimizer_state else 1
        self.shard_rank = self.rank if self.num_shards > 1 else 0  # whose slice of each unit
        trainable = trainable_groups(model, optimizer)
        ctx = ReduceContext(group, self.rank, self.world_size, offload.enabled, offload.pin_memory)
        self.own_groups = param_group_process_groups is not None
        contexts = _group_contexts(ctx, trainable, param_group_process_groups)
        self.groups: list[FlatGroup] = build_layout(
            [g for g in trainable if g],  # groups of frozen parameters only are left alone
            registration={p: i for i, p in enumerate(model.parameters())},
            names={p: n for n, p in model.named_parameters()},
            num_shards=[c.world_size if self.num_shards > 1 else 1 for c in contexts],
            bucket_numel=self.config.reduce_bucket_size,
        )
        self._contexts = contexts
        self.norm_group = norm_group
        self._norm_exclude = _excluded_ranges(self.groups, norm_exclude, self.shard_rank)
        self._broadcast_params()
        self.reducer = GradReducer(
            self.groups,
            self.config,
            ctx,
            contexts,
            predivide_factor=gradient_predivide_factor,
            comm_dtype=comm_dtype,
        )
        fp32_params = self.groups[0].flat.dtype == torch.float32
        self._master_is_flat = fp32_params and not self.config.shard_optimizer_state
        self.masters = [self._new_master(g) for g in self.groups]
        self._rewire_optimizer(trainable)
        low_precision = self.groups[0].flat.dtype in (torch.float16, torch.bfloat16)
        self._fused_copy = (
            offload.enabled and low_precision and accepts_fp16_param_groups(optimizer)
        )
        self._swap: StateSwap | None = None
        if offload.device == "nvme":
            largest = 4 * max(m.numel() for m in self.masters)
            if swapper is None:
                swapper = default_swapper(min(largest, 64 << 20), offload.buffer_count)
            folder = Path(str(offload.nvme_path)) / "ds_zero" / f"rank{dist_rank()}"
            self._swap = StateSwap(swapper, optimizer, self.masters, folder)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The trainable parameters, in layout order."""
        return [p for g in self.groups for p in g.params]

    # --- construction ----------------------------------------------------------------------------

    def _broadcast_params(self) -> None:
        for g, ctx in zip(self.groups, self._contexts):
            if ctx.world_size == 1:
                continue
            src = 0 if ctx.group is None else dist.get_global_rank(ctx.group, 0)
            ds_comm.broadcast(g.flat, src, group=ctx.group)

    def _shard_rank(self, group: FlatGroup) -> int:
        """Whose slice of each of ``group``'s units this rank owns."""
        return self._contexts[group.index].rank if self.num_shards > 1 else 0

    def _new_master(self, group: FlatGroup) -> torch.Tensor:
        if self._master_is_flat:
            return group.flat
        offload = self.config.offload_optimizer
        if offload.enabled:
            master = host_zeros(group.partition_numel, torch.float32, pin_memory=offload.pin_memory)
        else:
            master = torch.zeros(
                group.partition_numel, dtype=torch.float32, device=group.flat.device
            )
        self._master_from_params(group, master)
        return master

    def _master_from_params(
        self, group: FlatGroup, master: torch.Tensor, exclude: frozenset[str] = frozenset()
    ) -> None:
        """``group``'s master partition from its parameters, but for those named in
        ``exclude``."""
        rank = self._shard_rank(group)
        names = iter(group.names)
        for unit in group.units:
            members = [next(names, "") for _ in unit.params]  # a layout may have no names
            if exclude.isdisjoint(members):
                unit.in_partition(master).copy_(unit.shard(group.flat, rank))
                continue
            for name, (start, numel, at) in zip(members, _owned(unit, rank)):
                if numel and name not in exclude:
                    target = master.narrow(0, at, numel)
                    target.copy_(group.flat.narrow(0, unit.start + start, numel))

    def _rewire_optimizer(self, trainable: Sequence[Sequence[torch.nn.Parameter]]) -> None:
        if self.optimizer.state:
            raise ValueError(
                "the optimizer already has state; wrap it before its first step (restore "
                "checkpoints with ZeroOptimizer.load_state_dict)"
            )
        masters = iter(self.masters)
        for index, param_group in enumerate(self.optimizer.param_groups):
            param_group["params"] = [next(masters)] if trainable[index] else []

    # --- what the core calls (see _core.py's [Note: one step]) -----------------------------------

    def master_grads(self) -> list[torch.Tensor]:
        """The fp32 gradient of each group's master partition."""
        self.reducer.settle()  # a step with no backward since zero() reads zeros
        grads = [self._master_grad(g) for g in self.groups]
        self.reducer.release_low_precision()  # the fp32 copies above are all the step needs
        return grads

    def global_norm(self, grads: Sequence[torch.Tensor]) -> float:
        """The L2 norm of every rank's gradients, each element counted once."""
        sharded = self.config.shard_optimizer_state and self.world_size > 1
        if self.norm_group is not None or self._norm_exclude:
            return self._norm_across_groups(grads, sharded)
        if sharded or not self.own_groups or self.world_size == 1:
            # ds-optim reads group=None as "nothing to reduce": name the default group.
            norm_group = (self.group or dist.group.WORLD) if sharded else None
            return float(global_grad_norm(grads, 2.0, group=norm_group))
        # Stage 0 with own process groups: a group is replicated over its own group only, so
        # sum every rank's squares, each divided by its number of replicas.
        squares = torch.zeros((), dtype=torch.float64)
        for grad, ctx in zip(grads, self._contexts):
            squares += grad.double().pow(2).sum().cpu() / ctx.world_size
        squares = squares.to(grads[0].device)
        ds_comm.all_reduce(squares, group=self.group)
        return float(squares.sqrt())

    def _norm_across_groups(self, grads: Sequence[torch.Tensor], sharded: bool) -> float:
        """The norm summed over the data-parallel group and ``norm_group``, without the
        excluded parameters' elements (see ``norm_group``/``norm_exclude``)."""
        squares = torch.zeros((), dtype=torch.float64, device=grads[0].device)
        for grad, ctx, excluded in zip(grads, self._contexts, self._norm_exclude_by_group()):
            part = grad.double().pow(2).sum()
            for start, length in excluded:
                part -= grad.narrow(0, start, length).double().pow(2).sum()
            # Stage 0 replicates a group over its own process group: count each replica once.
            squares += part if sharded or not self.own_groups else part / ctx.world_size
        if self.world_size > 1 and (sharded or self.own_groups):
            ds_comm.all_reduce(squares, group=self.group)
        if self.norm_group is not None:
            ds_comm.all_reduce(squares, group=self.norm_group)
        return float(squares.clamp(min=0).sqrt()) if squares.isfinite() else float(squares)

    def _norm_exclude_by_group(self) -> list[list[tuple[int, int]]]:
        by_group: list[list[tuple[int, int]]] = [[] for _ in self.groups]
        for group_index, start, length in self._norm_exclude:
            by_group[group_index].append((start, length))
        return by_group

    def _master_grad(self, group: FlatGroup) -> torch.Tensor:
        """The fp32 gradient of ``group``'s master partition (see [Note: one step])."""
        part = self.reducer.part[group.index]
        if part is not None:
            return part if part.dtype == torch.float32 else part.float()
        full = self.reducer.full[group.index]
        assert full is not None
        if not self.config.shard_optimizer_state:
            return full if full.dtype == torch.float32 else full.float()
        master = self.masters[group.index]
        grad = torch.empty_like(master)
        for unit in group.units:
            unit.in_partition(grad).copy_(unit.shard(full, self._shard_rank(group)))
        return grad

    def apply(self, grads: Sequence[torch.Tensor]) -> None:
        """Step the wrapped optimizer on the masters and publish them into the parameters."""
        for master, grad in zip(self.masters, grads):
            master.grad = grad
        if self._swap is not None:
            self._swap.swap_in()
        low: list[torch.Tensor] = []
        if self._fused_copy:
            low = [
                torch.empty_like(m, dtype=g.flat.dtype) for m, g in zip(self.masters, self.groups)
            ]
            self.optimizer.step(fp16_param_groups=[[t] for t in low])
        elif not step_in_slices(self.optimizer, step_slice_numel()):
            self.optimizer.step()
        for master in self.masters:
            master.grad = None
        if self._swap is not None:
            self._swap.swap_out()
        self._publish(low or None)

    def _publish(self, low: Sequence[torch.Tensor] | None = None) -> None:
        """Write the masters into the model's parameters, gathering every rank's partition."""
        if self._master_is_flat:
            return
        self.residency.before_publish()
        for i, (group, master, ctx) in enumerate(zip(self.groups, self.masters, self._contexts)):
            flat = group.flat
            if low is not None:
                source = low[i].to(device=flat.device, non_blocking=True)
            else:
                source = upload_cast(master, flat.dtype, flat.device)
            if not self.config.shard_optimizer_state:
                flat.copy_(source)
                continue
            gather_partition(
                group,
                source,
                pg=ctx.group,
                rank=ctx.rank,
                world_size=ctx.world_size,
                bucket_numel=self.config.allgather_bucket_size,
                use_all_gather=self.config.allgather_partitions,
            )
        # a generator: a whole residency never walks it
        self.residency.after_publish(p for g in self.groups for p in g.params)

    def refresh_fp32_params(self, exclude: Collection[str] = ()) -> None:
        """Rebuild the fp32 master partitions from the model's parameters (DeepSpeed's name),
        e.g. after loading module weights without optimizer state; the parameters named in
        ``exclude`` (their masters already hold the loaded values, see :meth:`master_views`)
        are left as they are."""
        if self._master_is_flat:
            return
        with torch.no_grad():
            for group, master in zip(self.groups, self.masters):
                self._master_from_params(group, master, frozenset(exclude))

    def master_views(self) -> dict[str, torch.Tensor]:
        """Each trainable parameter whose elements this rank's fp32 master partition holds
        whole, by name, as a view of the master shaped like the parameter: where a load may
        write the loaded weights directly, before the model's parameters, so that they are
        copied into the parameters and not back into the masters (see ds-engine's [Note:
        weights loaded into the masters]). Empty where the masters are not separate fp32
        memory the CPU can write: the parameters' own buffer (fp32 without a sharded optimizer
        state), swapped to NVMe, or on an accelerator. Empty too for parameters in a lower
        precision: a failed load puts the masters back from the parameters
        (:meth:`refresh_fp32_params`), which is exact only when those are fp32 too."""
        if self._master_is_flat or self._swap is not None:
            return {}
        views: dict[str, torch.Tensor] = {}
        for group, master in zip(self.groups, self.masters):
            if master.device.type != "cpu" or group.flat.dtype != torch.float32:
                return {}
            rank = self._shard_rank(group)
            names = iter(group.names)
            for unit in group.units:
                for param, (_, numel, at) in zip(unit.params, _owned(unit, rank)):
                    name = next(names)
                    if numel and numel == param.numel():
                        views[name] = master.narrow(0, at, numel).view(param.shape)
        return views

    # --- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's master partition, optimizer state and the layout (the core adds the
        loss scaler and the counters)."""
        if self._swap is not None:
            self._swap.swap_in()
        try:
            optimizer_state = self.optimizer.state_dict()
            if self._swap is not None:  # detach from tensors that are about to be freed
                optimizer_state = _clone_tensors(optimizer_state)
        finally:
            if self._swap is not None:
                self._swap.swap_out()
        return {
            "format": FORMAT,
            "stage": self.config.stage,
            "rank": self.rank,
            "world_size": self.world_size,
            "num_shards": self.num_shards,
            "dtype": str(self.groups[0].flat.dtype),
            "layout": [g.describe() for g in self.groups],
            "masters": [m.detach() for m in self.masters],
            "optimizer": optimizer_state,
        }

    def load_state_dict(
        self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]
    ) -> Mapping[str, Any]:
        """Restore the masters and the optimizer state (see :meth:`ZeroOptimizer.load_state_dict
        <ds_zero.ZeroOptimizer.load_state_dict>`); return the saved state whose loss scaler and
        counters the core restores."""
        states = [state] if isinstance(state, Mapping) else list(state)
        if self.own_groups:
            states = _own_rank_state(states, self.rank, self.world_size)
        masters, optimizer_state, source = resolve_states(
            states,
            layouts=[g.describe() for g in self.groups],
            num_shards=self.num_shards,
            rank=self.shard_rank,
            elastic=self.config.elastic_checkpoint,
        )
        if self._swap is not None:
            self._swap.swap_in()
        self.optimizer.load_state_dict(optimizer_state)
        if self._swap is not None:
            self._swap.swap_out()
        if self.config.load_from_fp32_weights:
            with torch.no_grad():
                for master, saved in zip(self.masters, masters):
                    master.copy_(saved)
                self._publish()
        else:
            self.refresh_fp32_params()
        return source

    def checkpoint_shards(self) -> list[TensorShard]:
        """What this rank holds, per parameter range, for a universal checkpoint (see
        [Note: tensor shards of the flat layout])."""
        return zero_checkpoint_shards(self)

    def shard_destinations(self, manifest: Mapping[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
        """Where a full load may copy this rank's pieces as they are hashed (see
        :func:`~ds_zero._zero_shards.zero_shard_destinations`)."""
        return zero_shard_destinations(self, manifest)

    def load_checkpoint_shards(self, lookup: ShardLookup) -> None:
        """Fill this rank's masters, optimizer state and parameters from ``lookup`` (a
        checkpoint of any world size or stage)."""
        zero_load_checkpoint_shards(self, lookup)

    # --- memory ----------------------------------------------------------------------------------

    def memory_breakdown(self) -> MemoryBreakdown:
        """Bytes this rank holds for parameters, gradients and optimizer state right now.

        Example:
            >>> zero.memory_breakdown().model_states  # params + grads + optimizer state
        """
        params = sum(g.flat.nbytes for g in self.groups)
        grads, grads_host, staging = self.reducer.nbytes()
        seen: set[int] = {g.flat.data_ptr() for g in self.groups}
        optimizer_state = host = 0
        tensors = list(self.masters)
        for master in self.masters:
            tensors += [
                v for v in self.optimizer.state.get(master, {}).values() if torch.is_tensor(v)
            ]
        for t in tensors:
            if t.data_ptr() in seen or t.numel() <= 1:  # scalars such as Adam's step
                continue
            seen.add(t.data_ptr())
            optimizer_state += t.nbytes
            if self.config.offload_optimizer.enabled and t.device.type == "cpu":
                host += t.nbytes
        return MemoryBreakdown(
            params=params,
            grads=grads,
            optimizer_state=optimizer_state,
            buffers=staging,
            # with nvme, the swapper's page-locked staging buffers are host memory too
            host=host + grads_host + (self._swap.pinned_bytes if self._swap is not None else 0),
        )


def _excluded_ranges(
    groups: Sequence[FlatGroup], params: Sequence[torch.nn.Parameter], shard_rank: int
) -> list[tuple[int, int, int]]:
    """``(group, start, length)`` of each excluded parameter's elements inside this rank's
    master gradient (the whole flat buffer for stage 0, the own partition otherwise)."""
    wanted = {id(p) for p in params}
    ranges: list[tuple[int, int, int]] = []
    for group in groups:
        for unit in group.units:
            sharded = unit.num_shards > 1
            own_lo = shard_rank * unit.shard_numel if sharded else 0
            own_hi = own_lo + unit.shard_numel if sharded else unit.padded_numel
            for p, offset in zip(unit.params, unit.offsets):
                if id(p) not in wanted:
                    continue
                lo, hi = max(offset, own_lo), min(offset + p.numel(), own_hi)
                if lo < hi:
                    base = unit.shard_start - own_lo if sharded else unit.start
                    ranges.append((group.index, base + lo, hi - lo))
    return ranges


def _group_contexts(
    ctx: ReduceContext,
    trainable: Sequence[Sequence[torch.nn.Parameter]],
    process_groups: Sequence[Any] | None,
) -> list[ReduceContext]:
    """The reduction context of each non-empty param group (its own process group or ``ctx``)."""
    if process_groups is None:
        return [ctx for g in trainable if g]
    if len(process_groups) != len(trainable):
        raise ValueError(
            f"param_group_process_groups has {len(process_groups)} entries for "
            f"{len(trainable)} optimizer param groups; pass one per group (None: the default)"
        )
    contexts = []
    for members, pg in zip(trainable, process_groups):
        if not members:
            continue
        if pg is None:
            contexts.append(ctx)
            continue
        rank, size = dp_rank_and_size(pg)
        if ctx.world_size % size:
            raise ValueError(
                f"a param group's process group has {size} ranks, which does not divide the "
                f"data-parallel size {ctx.world_size}; it must be a subgroup of group"
            )
        contexts.append(ReduceContext(pg, rank, size, ctx.offload, ctx.pin_memory))
    return contexts


def _own_rank_state(
    states: list[Mapping[str, Any]], rank: int, world_size: int
) -> list[Mapping[str, Any]]:
    """This rank's saved state: param groups on their own process groups hold different
    parameters on different ranks (MoE experts), so no other rank's state can stand in."""
    saved = {int(s["world_size"]) for s in states}
    if saved != {world_size}:
        raise ValueError(
            f"this checkpoint was saved on {sorted(saved)} data-parallel ranks and this run has "
            f"{world_size}: param groups with their own process groups (MoE experts) can only "
            "be restored on the same number of ranks"
        )
    own = [s for s in states if int(s["rank"]) == rank]
    if not own:
        raise ValueError(f"no saved state for rank {rank} among {[s['rank'] for s in states]}")
    return own


def _clone_tensors(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone_tensors(v) for v in obj]
    return obj


def _owned(unit: FlatUnit, rank: int) -> Iterator[tuple[int, int, int]]:
    """For each member of ``unit``: where the part rank ``rank``'s shard holds starts in the
    unit (its element offset), how many elements it holds (0: none), and where they sit in
    the rank's partition."""
    low = rank * unit.shard_numel
    high = low + unit.shard_numel
    for param, offset in zip(unit.params, unit.offsets):
        start, end = max(offset, low), min(offset + param.numel(), high)
        numel = max(0, end - start)
        yield start, numel, unit.shard_start + (start - low) if numel else 0
