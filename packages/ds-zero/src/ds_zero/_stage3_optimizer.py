"""``Stage3Optimizer``: ZeRO stage 3 training: partitioned parameters gathered around each module
(``_stage3.py``), gradients reduce-scattered straight into this rank's fp32 shard, and the wrapped
optimizer stepping only that shard.

[Note: stage 3 step]
Each optimizer param group's trainable parameters are laid out as fp32 *sub-groups*: whole
parameters' shards (``p.ds_tensor``, ``s = ceil(numel / world)`` elements each, padding included)
concatenated until ``sub_group_size`` elements are exceeded. The wrapped optimizer's param groups
are re-pointed at those flat masters, next to an fp32 gradient shard of the same layout
(allocated at the first gradient after a step and freed by ``zero_grad``, as torch's
``set_to_none``: no rank holds gradient memory between steps). For fp32 parameters whose shards
live where the masters do, ``p.ds_tensor`` becomes a view of the master (no second copy). The
gradients are reduced into those shards by :class:`~ds_zero._shard_reduce.ShardGradReducer`
(``_shard_reduce.py``'s [Note: stage 3 gradients]), the per-parameter-shard layout of the
reducer interface that stages 0-2's flat ``GradReducer`` has too, through the same collective
queue and side stream; its gradient hook also releases the parameter (the partitioned
residency). ``step()`` is the core's (``_core.py``, [Note: one step]):
global norm over the group, non-finite skip, one scaling for loss scale and clipping,
optimizer step, shards written back (cast to the parameter dtype; under
``offload_optimizer`` with ds-optim's ``CPUAdam`` and 16-bit parameters the optimizer writes the
cast copies in its own pass, ZeRO-Offload's fused copy), persistent parameters gathered whole
again.

Every rank must use the same parameters in a backward (the reduce-scatters are issued in the
order gradients complete); a parameter no rank used gets no reduction (its gradient is zero).

[Note: stage 3 param groups with their own process group]
``param_group_process_groups`` gives a param group its own process group, a subgroup of the
data-parallel group: MoE experts and their expert-data-parallel group (DeepSpeed's
``real_dp_process_group``). Their parameters are partitioned over that group
(``ParamPartitioner.sub_partitioner``, ``_partitioned.py``'s [Note: parameters on their own
group]): the ranks of one expert-parallel group hold different experts, and each expert is
sharded over the ranks that hold it. Their gradients are reduce-scattered over that group and
divided by the data-parallel size (``_shard_reduce.py``), as at stages 0-2 (``_reduce.py``'s
[Note: param groups with their own process group]). The squared norm is summed over the
data-parallel group as before: a dense shard is one 1/dp slice, an expert shard one slice of an
expert no rank of another expert-data-parallel group holds, so every element counts once.
Checkpoint shards name parameters by ``checkpoint_names`` when given (ds-engine passes the
experts' global-expert-id names), so the same expert has one name whatever the ``ep_size``,
and a checkpoint reshards across ``ep_size`` and world size.

[Note: ZeRO-Infinity sub-group pipeline]
With ``offload_optimizer.device = "nvme"`` the optimizer state of every master sub-group lives
in files (``<nvme_path>/ds_zero/rank<r>/group<i>_<name>.swp``, through a
:class:`~ds_zero.api.TensorSwapper`, ds-offload-aio's ``AsyncTensorSwapper`` by default) and at
most two sub-groups' state is in host memory at once. ``step()`` walks the sub-groups in order:
it waits for sub-group ``i``'s state (and for sub-group ``i - 1``'s writes), starts reading
sub-group ``i + 1``'s, steps the wrapped optimizer on sub-group ``i`` alone (its param groups
narrowed to that master for the call), and starts writing sub-group ``i``'s state back. So the
read of the next sub-group and the write of the previous one overlap the optimizer step of the
current one, as far as the swapper's staging buffers reach: ``AsyncTensorSwapper`` keeps
``buffer_count`` pieces in flight and completes the oldest when it needs a buffer, so a
sub-group larger than its pool is partly read before the step starts. ``sub_group_size`` sets
the granularity, as in DeepSpeed. With ``offload_param.device = "nvme"`` too (ZeRO-Infinity's
canonical setup) the parameter shards are in their own files as well (``_param_offload.py``'s
[Note: the NVMe shard store]), and host memory holds the fp32 masters, the gradient shards
during a step, the resident parameter shards and the two swappers' page-locked buffers:
:meth:`Stage3Optimizer.host_memory` itemises it, ``memory_breakdown().host`` sums it, and it is
logged at construction.
"""

# DeepSpeed's ZeRO-3 parameter attributes (p.ds_id, p.ds_tensor, p.ds_status, ...) are set on
# torch Parameters at run time, which the type checker cannot see.
# pyright: reportAttributeAccessIssue=false

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ds_comm
from ds_optim import global_grad_norm
from ds_zero._core import GradientCore
from ds_zero._mics import MicsGroups
from ds_zero._offload import StateSwap, accepts_fp16_param_groups, default_swapper, host_zeros
from ds_zero._optimizer import (
    _dp_rank_and_size,
    _trainable_groups,
    check_step_options,
    dist_rank,
    step_in_slices,
)
from ds_zero._param_access import register_param_owner
from ds_zero._partitioned import ParamPartitioner, shard_bounds
from ds_zero._residency import PartitionedResidency
from ds_zero._shard_reduce import ShardGradReducer, Slot
from ds_zero._shards import ShardLookup, TensorShard
from ds_zero._stage3 import PrefetchStats, Stage3Hooks
from ds_zero._streams import CollectiveQueue
from ds_zero._zeropp import quantized_reduce_scatter
from ds_zero.api import MemoryBreakdown, TensorSwapper, ZeroConfig

__all__ = ["Stage3Optimizer"]

logger = logging.getLogger("ds_zero")

_FORMAT = "ds_zero.stage3/1"


class Stage3Optimizer(GradientCore):
    """ZeRO stage 3 around ``model`` and ``optimizer`` over a data-parallel group (see
    [Note: stage 3 step]); the same interface as :class:`~ds_zero.ZeroOptimizer`.

    Parameters not yet partitioned (a model built outside ``ds_zero.Init``) are broadcast from
    the group's first rank and partitioned; the user calls ``model(...)`` as usual.

    Args:
        model: the module (trainable parameters in one dtype).
        optimizer: a ``torch.optim`` optimizer over the model's trainable parameters, no state.
        config: the ``zero_optimization`` section with ``stage=3``.
        group: the data-parallel process group (None: the default group).
        loss_scaler: ds-optim's ``DynamicLossScaler``/``StaticLossScaler`` for fp16.
        gradient_accumulation_steps: micro-batches per optimizer step.
        gradient_clipping: max global gradient norm (0: no clipping).
        gradient_predivide_factor: as :class:`~ds_zero.ZeroOptimizer`.
        communication_data_type: as :class:`~ds_zero.ZeroOptimizer`.
        partitioner: the :class:`~ds_zero.ParamPartitioner` that partitioned the model; None:
            the one of parameters already partitioned (``ds_zero.Init``), else a new one built
            from ``config``.
        swapper: where optimizer state goes with ``offload_optimizer.device="nvme"``
            (ZeRO-Infinity; default: ds-offload-aio's ``AsyncTensorSwapper``); see
            [Note: ZeRO-Infinity sub-group pipeline].
        norm_group: as :class:`~ds_zero.ZeroOptimizer`: a further group (pipeline or model
            parallel) over which the squared gradient norm is summed.
        norm_exclude: as :class:`~ds_zero.ZeroOptimizer`: parameters another rank of
            ``norm_group`` counts in the norm.
        param_group_process_groups: one entry per optimizer param group: the subgroup of
            ``group`` its parameters are partitioned and reduced over (MoE experts: their
            expert-data-parallel group), None for ``group``; see [Note: stage 3 param groups
            with their own process group].
        checkpoint_names: the name under which :meth:`checkpoint_shards` saves (and
            :meth:`load_checkpoint_shards` looks up) a parameter, by its module name (default:
            the module name): MoE experts by global expert id, so checkpoints reshard across
            ``ep_size``.

    Example:
        >>> zero = Stage3Optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
        ...                        ZeroConfig(stage=3), group=dp_group)
        >>> zero.backward(model(batch))
        >>> zero.step()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: ZeroConfig | None = None,
        *,
        group: Any = None,
        loss_scaler: Any = None,
        gradient_accumulation_steps: int = 1,
        gradient_clipping: float = 0.0,
        gradient_predivide_factor: float | None = None,
        communication_data_type: torch.dtype | str | None = None,
        partitioner: ParamPartitioner | None = None,
        swapper: TensorSwapper | None = None,
        norm_group: Any = None,
        norm_exclude: Sequence[torch.nn.Parameter] = (),
        param_group_process_groups: Sequence[Any] | None = None,
        checkpoint_names: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config if config is not None else ZeroConfig(stage=3)
        if not self.config.shard_parameters:
            raise ValueError(
                f"zero_optimization.stage = {self.config.stage}: Stage3Optimizer needs stage 3; "
                "use ZeroOptimizer (or ds_zero.build_zero_optimizer) for stages 0-2"
            )
        comm_dtype = check_step_options(
            gradient_accumulation_steps,
            gradient_clipping,
            gradient_predivide_factor,
            communication_data_type,
        )
        self.module, self.optimizer = model, optimizer
        self.mics = MicsGroups.build(self.config, group)  # [Note: MiCS]: over its shard group
        self.group = group if self.mics is None else self.mics.shard_group
        self.loss_scaler = loss_scaler
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.gradient_clipping = float(gradient_clipping)
        self.rank, self.world_size = _dp_rank_and_size(self.group)
        self._comm_dtype = comm_dtype
        self._predivide_factor = gradient_predivide_factor
        self.partitioner = partitioner or self._partitioner_of(model)
        if self.partitioner.world_size != self.world_size:
            raise ValueError(
                f"the partitioner spans {self.partitioner.world_size} ranks and the group "
                f"{self.world_size}; build both over the same data-parallel group"
            )
        named = list(model.named_parameters())
        self.names = {id(p): n for n, p in named}
        self._checkpoint_names = dict(checkpoint_names or {})
        own_groups = self._partition_own_groups(named, param_group_process_groups)
        if self.mics is not None:
            if own_groups:
                raise ValueError(
                    "mics_shard_size with param_group_process_groups (MoE experts) is not "
                    "implemented; remove one of them"
                )
            self.mics.broadcast(p for _, p in named)
        self.partitioner.partition(
            [p for _, p in named], names=[n for n, _ in named], broadcast_from=0
        )
        self.trainable = _trainable_groups(model, optimizer)
        self._param_dtype = next(p.dtype for g in self.trainable for p in g)
        self._build_masters()
        self._fused_copy = (
            self.config.offload_optimizer.enabled
            and self._param_dtype in (torch.float16, torch.bfloat16)
            and accepts_fp16_param_groups(optimizer)
        )
        self._swap = self._state_swap(swapper)
        self.norm_group = norm_group
        self._norm_exclude = self._excluded_slots(norm_exclude)
        # ZeRO++ qgZ: how gradients are reduced (_zeropp.py's [Note: ZeRO++])
        qgz = quantized_reduce_scatter if self.config.zero_quantized_gradients else None
        if self.mics is not None:  # then the mean over the replicas
            qgz = self.mics.reduce(qgz or ds_comm.reduce_scatter_tensor)
        residency = PartitionedResidency(
            model, self.partitioner, self.config, group=self.group, world_size=self.world_size
        )
        self._partitioned = residency
        self.queue = CollectiveQueue(
            self._grad_device(),
            overlap=bool(self.config.overlap_comm),
            world_size=self.world_size,
            predivide_factor=gradient_predivide_factor,
            comm_dtype=comm_dtype,
        )
        # the per-parameter-shard layout; its gradient hook releases the parameter (residency)
        self.reducer = ShardGradReducer(
            self._slots_params(),
            self._slots,
            self.masters,
            self.config,
            self.queue,
            group=self.group,
            world_size=self.world_size,
            release=residency.release,
            names=self.names,
            own_groups=own_groups,
            reduce_scatter=qgz,
        )
        self._init_core(residency)
        register_param_owner(self, self._slots_params())
        host = self.host_memory()
        if host:
            logger.info(
                "ZeRO-3 offload (optimizer: %s, parameters: %s): %.1f MiB of host memory on "
                "this rank (%s)",
                self.config.offload_optimizer.device,
                self.config.offload_param.device,
                sum(host.values()) / 2**20,
                ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in host.items()),
            )

    # --- construction ----------------------------------------------------------------------------

    def _partition_own_groups(
        self, named: Sequence[tuple[str, torch.nn.Parameter]], process_groups: Sequence[Any] | None
    ) -> dict[int, tuple[Any, int]]:
        """Partition the param groups that have their own process group over it (see [Note:
        stage 3 param groups with their own process group]); by parameter ``id``, its group and
        the group's size."""
        groups = self.optimizer.param_groups
        if process_groups is None or all(pg is None for pg in process_groups):
            return {}
        if len(process_groups) != len(groups):
            raise ValueError(
                f"param_group_process_groups has {len(process_groups)} entries for "
                f"{len(groups)} optimizer param groups; pass one per group (None: the default)"
            )
        name_of = {id(p): n for n, p in named}
        own: dict[int, tuple[Any, int]] = {}
        for param_group, pg in zip(groups, process_groups):
            if pg is None:
                continue
            params = list(param_group["params"])
            taken = [name_of.get(id(p), "?") for p in params if hasattr(p, "ds_partitioner")]
            if taken:
                raise ValueError(
                    f"parameters {taken[:3]} of a param group with its own process group (MoE "
                    "experts) were already partitioned over the data-parallel group (built "
                    "under ds_zero.Init); build the MoE layers outside ds_zero.Init"
                )
            child = self.partitioner.sub_partitioner(pg)
            child.partition(
                params, names=[name_of.get(id(p), "?") for p in params], broadcast_from=0
            )
            own.update({id(p): (pg, child.world_size) for p in params})
        return own

    def _shard_range(self, p: torch.nn.Parameter) -> tuple[int, int]:
        """``[start, stop)`` of ``p``'s elements this rank holds, over the group it is
        partitioned over."""
        owner = p.ds_partitioner
        return shard_bounds(p.ds_numel, owner.world_size, owner.rank)

    def _partitioner_of(self, model: torch.nn.Module) -> ParamPartitioner:
        """The partitioner of parameters partitioned already (``ds_zero.Init``), else a new one
        from the config (with the NVMe shard store for ``offload_param.device="nvme"``)."""
        existing = {
            id(p.ds_partitioner): p.ds_partitioner
            for p in model.parameters()
            if hasattr(p, "ds_partitioner")
        }
        if len(existing) > 1:
            raise ValueError(
                f"the model's parameters were partitioned by {len(existing)} different "
                "partitioners (ds_zero.Init contexts with different groups or offload); build "
                "the model under one Init, or pass partitioner="
            )
        if existing:
            partitioner = next(iter(existing.values()))
            threshold = self.config.stage3_param_persistence_threshold
            partitioner.apply_persistence_threshold(threshold)
            return partitioner
        offload = self.config.offload_param
        store = None
        if offload.device == "nvme":
            from ds_zero._param_offload import NvmeShardStore

            store = NvmeShardStore.from_config(offload, self.rank)
        return ParamPartitioner(
            self.group,
            persistence_threshold=self.config.stage3_param_persistence_threshold,
            offload=offload,
            shard_store=store,
        )

    def _state_swap(self, swapper: TensorSwapper | None) -> StateSwap | None:
        """The NVMe swap of the optimizer state (``offload_optimizer.device = "nvme"``)."""
        offload = self.config.offload_optimizer
        if offload.device != "nvme":
            return None
        if swapper is None:
            largest = 4 * max((m.numel() for m in self.masters), default=1)
            swapper = default_swapper(min(largest, 64 << 20), offload.buffer_count)
        folder = Path(str(offload.nvme_path)) / "ds_zero" / f"rank{dist_rank()}"
        return StateSwap(swapper, self.optimizer, self.masters, folder)

    def _excluded_slots(
        self, params: Sequence[torch.nn.Parameter]
    ) -> dict[int, list[tuple[int, int]]]:
        """``{sub-group: [(offset, numel), ...]}`` of the shards of the excluded parameters."""
        ranges: dict[int, list[tuple[int, int]]] = {}
        for p in params:
            slot = self._slots.get(id(p))
            if slot is not None:
                ranges.setdefault(slot.index, []).append((slot.offset, slot.numel))
        return ranges

    def _slots_params(self) -> list[torch.nn.Parameter]:
        return [p for group in self.trainable for p in group]

    def _build_masters(self) -> None:
        """Lay the trainable shards out as fp32 sub-groups (see [Note: stage 3 step])."""
        if self.optimizer.state:
            raise ValueError(
                "the optimizer already has state; wrap it before its first step (restore "
                "checkpoints with Stage3Optimizer.load_state_dict)"
            )
        offload = self.config.offload_optimizer
        self.masters: list[torch.Tensor] = []
        self._slots: dict[int, Slot] = {}
        store = self.partitioner.shard_store
        for param_group, params in zip(self.optimizer.param_groups, self.trainable):
            subs: list[list[torch.nn.Parameter]] = [[]]
            size = 0
            for p in params:
                if subs[-1] and size + p.ds_tensor.numel() > self.config.sub_group_size:
                    subs.append([])
                    size = 0
                subs[-1].append(p)
                size += p.ds_tensor.numel()
            group_masters = []
            for sub in subs if params else []:
                numel = sum(p.ds_tensor.numel() for p in sub)
                if offload.enabled:
                    master = host_zeros(numel, torch.float32, pin_memory=offload.pin_memory)
                else:
                    master = torch.zeros(numel, dtype=torch.float32, device=sub[0].device)
                offset = 0
                for p in sub:
                    slot = Slot(len(self.masters), offset, p.ds_tensor.numel())
                    if store is not None:
                        store.fetch([p])
                    view = master.narrow(0, offset, slot.numel)
                    view.copy_(p.ds_tensor)
                    if store is not None:
                        store.evict([p])
                    elif p.dtype == torch.float32 and p.ds_tensor.device == master.device:
                        p.ds_tensor = view  # same values: the shard is the master
                        slot.aliased = True
                    self._slots[id(p)] = slot
                    offset += slot.numel
                self.masters.append(master)
                group_masters.append(master)
            param_group["params"] = group_masters

    @property
    def grad_shards(self) -> list[torch.Tensor | None]:
        """The fp32 gradient shards, one per master sub-group (None between steps)."""
        return self.reducer.grad_shards

    @property
    def hooks(self) -> Stage3Hooks:
        """The partitioned residency's module hooks (gather/release around each module)."""
        return self._partitioned.hooks

    @property
    def prefetch_stats(self) -> PrefetchStats:
        """Prefetch hits, misses and trace invalidations so far."""
        return self._partitioned.stats

    # --- gradient reduction ----------------------------------------------------------------------

    def _grad_device(self) -> torch.device:
        """Where gradients are produced: the device the parameters compute on."""
        params = self._slots_params()
        return self.partitioner._device_of(params[0]) if params else torch.device("cpu")

    # --- the layout the core drives (see _core.py's [Note: one step]) ----------------------------

    def _master_grads(self) -> list[torch.Tensor]:
        return [self.reducer.grad_shard(i) for i in range(len(self.masters))]

    def _global_norm(self, grads: Sequence[torch.Tensor]) -> float:
        if self.norm_group is None and not self._norm_exclude:
            norm_group = (self.group or dist.group.WORLD) if self.world_size > 1 else None
            return float(global_grad_norm(grads, 2.0, group=norm_group))
        # Summed over the data-parallel group (disjoint shards) and norm_group (other
        # parameters), without the excluded parameters' shards (counted by another rank).
        device = grads[0].device if grads else torch.device("cpu")
        squares = torch.zeros((), dtype=torch.float64, device=device)
        for index, grad in enumerate(grads):
            part = grad.double().pow(2).sum()
            for offset, numel in self._norm_exclude.get(index, ()):
                part -= grad.narrow(0, offset, numel).double().pow(2).sum()
            squares += part
        if self.world_size > 1:
            ds_comm.all_reduce(squares, group=self.group)
        if self.norm_group is not None:
            ds_comm.all_reduce(squares, group=self.norm_group)
        return float(squares.clamp(min=0).sqrt()) if squares.isfinite() else float(squares)

    def _apply(self, grads: Sequence[torch.Tensor]) -> None:
        for master, grad in zip(self.masters, grads):
            master.grad = grad
        # CPUAdam writes the low-precision shards in the same pass (ZeRO-Offload's fused copy)
        low = (
            [torch.empty_like(m, dtype=self._param_dtype) for m in self.masters]
            if self._fused_copy
            else []
        )
        if self._swap is None:
            self._step_sub_groups(range(len(self.masters)), low)
        else:
            self._step_swapped(self._swap, low)
        for master in self.masters:
            master.grad = None
        self._publish(low or None)

    def _step_swapped(self, swap: StateSwap, low: list[torch.Tensor]) -> None:
        """Step one sub-group at a time, its state read from NVMe while the previous one
        steps (see [Note: ZeRO-Infinity sub-group pipeline])."""
        count = len(self.masters)
        swap.swap_in([0], async_op=True)
        for index in range(count):
            swap.wait()  # this sub-group's state is in; the previous one's writes are done
            if index + 1 < count:
                swap.swap_in([index + 1], async_op=True)
            self._step_sub_groups([index], low)
            swap.swap_out([index], async_op=True)
        swap.wait()

    def _step_sub_groups(self, indices: Iterable[int], low: list[torch.Tensor]) -> None:
        """Step the wrapped optimizer on the masters of ``indices`` only (the param groups
        are narrowed for the call and restored after it)."""
        wanted = {id(self.masters[i]): i for i in indices}
        groups = self.optimizer.param_groups
        saved = [g["params"] for g in groups]
        try:
            if len(wanted) < len(self.masters):
                for group, params in zip(groups, saved):
                    group["params"] = [m for m in params if id(m) in wanted]
            if low:
                self.optimizer.step(
                    fp16_param_groups=[[low[wanted[id(m)]] for m in g["params"]] for g in groups]
                )
            elif not step_in_slices(self.optimizer):  # [Note: stepping a flat master in slices]
                self.optimizer.step()
        finally:
            for group, params in zip(groups, saved):
                group["params"] = params

    @contextlib.contextmanager
    def _resident_state(self) -> Iterator[None]:
        """The optimizer state swapped in from NVMe for the duration (a no-op otherwise)."""
        if self._swap is None:
            yield
            return
        self._swap.swap_in()
        try:
            yield
        finally:
            self._swap.swap_out()

    def _publish(self, low: list[torch.Tensor] | None = None) -> None:
        """Write the masters (or their low-precision copies) into the shards, and persistent
        parameters whole."""
        sources = low if low is not None else self.masters
        self.residency.before_publish()
        with torch.no_grad():
            for p, master in self._resident_shards(sources):
                p.ds_tensor.copy_(master)
            self.residency.after_publish(self._slots_params())

    def refresh_fp32_params(self) -> None:
        """Rebuild the fp32 masters from the parameter shards (DeepSpeed's name)."""
        with torch.no_grad():
            for p, master in self._resident_shards(self.masters):
                master.copy_(p.ds_tensor)

    def _resident_shards(
        self, flats: list[torch.Tensor]
    ) -> Iterator[tuple[torch.nn.Parameter, torch.Tensor]]:
        """Each trainable parameter whose shard is not a view of its master, with its slice
        of ``flats`` (masters or their copies), its shard fetched from NVMe meanwhile."""
        store = self.partitioner.shard_store
        for p in self._slots_params():
            slot = self._slots[id(p)]
            if slot.aliased:
                continue
            if store is not None:
                store.fetch([p])
            yield p, flats[slot.index].narrow(0, slot.offset, slot.numel)
            if store is not None:
                store.evict([p])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Free the gradient shards: the next gradient starts from zero (``set_to_none`` is
        accepted for torch parity)."""
        del set_to_none
        self.reducer.zero()

    def destroy(self) -> None:
        """Remove the module and gradient hooks (DeepSpeed's name); the parameters stay
        partitioned."""
        self.residency.remove()
        self.reducer.remove_hooks()

    # --- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: its fp32 masters and optimizer state (same world size to load;
        use :meth:`checkpoint_shards` for a reshardable checkpoint)."""
        with self._resident_state():
            optimizer_state = self.optimizer.state_dict()
            # torch's state dict shares the per-parameter dicts the swap-out empties
            optimizer_state["state"] = {k: dict(v) for k, v in optimizer_state["state"].items()}
        return {
            "format": _FORMAT,
            "stage": 3,
            "rank": self.rank,
            "world_size": self.world_size,
            "masters": [m.detach() for m in self.masters],
            "optimizer": optimizer_state,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            "counters": self._counters(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from this rank's :meth:`state_dict`."""
        if state.get("format") != _FORMAT or int(state["world_size"]) != self.world_size:
            raise ValueError(
                f"this state is {state.get('format')!r} from {state.get('world_size')} ranks; "
                f"Stage3Optimizer.load_state_dict takes its own state ({_FORMAT}) from "
                f"{self.world_size} ranks (reshard through checkpoint_shards instead)"
            )
        saved = state["masters"]
        if [m.numel() for m in saved] != [m.numel() for m in self.masters]:
            raise ValueError("the saved masters do not match this model's partition layout")
        with torch.no_grad():
            for master, value in zip(self.masters, saved):
                master.copy_(value)
        with self._resident_state():
            self.optimizer.load_state_dict(state["optimizer"])
        self._publish()
        if self.loss_scaler is not None and state.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        self._load_counters(state.get("counters", {}))
        self.zero_grad()

    def checkpoint_shards(self) -> list[TensorShard]:
        """This rank's piece of every parameter and of its elementwise optimizer state (see
        ``_shards.py``'s [Note: tensor shards]); persistent parameters report their r-th slice
        too, so every element is covered exactly once."""
        with self._resident_state():  # the views keep the swapped-in state alive
            return self._checkpoint_shards()

    def _checkpoint_shards(self) -> list[TensorShard]:
        if self.mics is not None and self.mics.replica:  # the first replica saves ([Note: MiCS])
            return []
        shards = []
        trainable = {id(p) for p in self._slots_params()}
        for name, p in self.module.named_parameters():
            start, stop = self._shard_range(p)
            n = stop - start
            name = self._checkpoint_names.get(name, name)
            if id(p) not in trainable:
                values = {"param": p.ds_tensor.narrow(0, 0, n).float()}
            else:
                slot = self._slots[id(p)]
                master = self.masters[slot.index]
                values = {"param": master.narrow(0, slot.offset, n)}
                for key, value in self.optimizer.state.get(master, {}).items():
                    if torch.is_tensor(value) and value.shape == master.shape:
                        values[key] = value.narrow(0, slot.offset, n)
            shards.append(TensorShard(name, p.ds_shape, p.dtype, start, stop, values))
        return shards

    def load_checkpoint_shards(self, lookup: ShardLookup) -> None:
        """Fill this rank's masters, elementwise optimizer state and parameter shards from
        ``lookup`` (a checkpoint of any world size or stage).

        Scalar optimizer state (Adam's ``step``) is not in a lookup: it is kept when the
        optimizer has state already, else set to :attr:`global_steps`; the checkpoint reader
        restores the saved scalars after this call.
        """
        with self._resident_state():
            self._load_checkpoint_shards(lookup)
        self.zero_grad()

    def _load_checkpoint_shards(self, lookup: ShardLookup) -> None:
        trainable = {id(p) for p in self._slots_params()}
        states: list[dict[str, torch.Tensor]] = [{} for _ in self.masters]
        with torch.no_grad():
            for name, p in self.module.named_parameters():
                start, stop = self._shard_range(p)
                n = stop - start
                name = self._checkpoint_names.get(name, name)
                if id(p) not in trainable:
                    try:
                        found = lookup(name, start, stop)
                    except (KeyError, ValueError):  # the model's own weight, saved elsewhere
                        continue
                    p.ds_tensor.narrow(0, 0, n).copy_(found["param"])
                    continue
                found = lookup(name, start, stop)
                if "param" not in found:
                    raise KeyError(f"the checkpoint has no 'param' values for {name!r}")
                slot = self._slots[id(p)]
                master = self.masters[slot.index]
                master.narrow(0, slot.offset, n).copy_(found["param"])
                for key, value in found.items():
                    if key != "param":
                        target = states[slot.index].setdefault(key, torch.zeros_like(master))
                        target.narrow(0, slot.offset, n).copy_(value)
            for master, state in zip(self.masters, states):
                old = self.optimizer.state.pop(master, {})
                if not state:
                    continue
                scalars = {k: v for k, v in old.items() if not _elementwise(v, master)}
                if not scalars:
                    scalars = {"step": torch.tensor(float(self.global_steps))}
                self.optimizer.state[master] = {**scalars, **state}
            self._publish()
            frozen = [p for p in self.module.parameters() if id(p) not in trainable]
            self.partitioner.write_full_from_shards([p for p in frozen if p.ds_persist])

    # --- memory ----------------------------------------------------------------------------------

    def memory_breakdown(self) -> MemoryBreakdown:
        """Bytes this rank holds: ``params`` are the shards plus whole persistent parameters,
        ``grads`` the fp32 gradient shards from a backward to the step after it (freed
        between steps), ``buffers`` the peak gathered working set plus the largest reduction
        bucket, ``host`` what offload keeps in host memory (see :meth:`host_memory`)."""
        params = self.partitioner.shard_nbytes()
        grads = sum(4 * m.numel() for m in self.masters)  # fp32, while gradients exist
        optimizer_state = sum(self._optimizer_state_bytes().values())
        working = self.residency.working_bytes
        return MemoryBreakdown(
            params=params,
            grads=grads,
            optimizer_state=optimizer_state,
            buffers=working + self.reducer.bucket_bytes,
            host=sum(self.host_memory().values()),
        )

    def _optimizer_state_bytes(self) -> dict[str, int]:
        """Bytes of the fp32 masters (unless they are the shards) and of the optimizer's
        elementwise state in memory now (swapped-out state is on NVMe)."""
        aliased = {s.index for s in self._slots.values() if s.aliased}
        masters = state = 0
        for i, master in enumerate(self.masters):
            masters += 0 if i in aliased else master.nbytes
            state += sum(
                v.nbytes
                for v in self.optimizer.state.get(master, {}).values()
                if torch.is_tensor(v) and v.numel() > 1
            )
        return {"masters": masters, "optimizer_state": state}

    def host_memory(self) -> dict[str, int]:
        """Bytes this rank keeps in host memory because of offload, by kind: fp32 masters,
        optimizer state and gradient shards (``offload_optimizer``), parameter shards
        (``offload_param``: all of them with cpu, the resident ones with nvme) and the
        page-locked staging buffers of the NVMe swappers. Empty without offload.

        Example:
            >>> sum(zero.host_memory().values()) == zero.memory_breakdown().host
        """
        host: dict[str, int] = {}
        if self.config.offload_optimizer.enabled:
            host.update(self._optimizer_state_bytes())
            host["grads"] = sum(g.nbytes for g in self.grad_shards if g is not None)
        if self.config.offload_param.enabled:
            host["param_shards"] = sum(
                p.ds_tensor.nbytes
                for p in self.partitioner.params
                if p.ds_tensor.device.type == "cpu"
            )
        staging = self._swap.pinned_bytes if self._swap is not None else 0
        store = self.partitioner.shard_store
        staging += int(getattr(store, "pinned_bytes", 0) or 0)
        if staging:
            host["pinned_staging"] = staging
        return host


def _elementwise(value: Any, master: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.shape == master.shape
