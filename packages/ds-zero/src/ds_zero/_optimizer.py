"""``ZeroOptimizer``: a model and any elementwise ``torch.optim`` optimizer, trained with ZeRO
stage 0, 1 or 2 over a data-parallel group.

The step itself is the core's (``_core.py``, [Note: one step]); this class supplies the flat
layout: gradients in flat per-group buckets (``_reduce.py``), fp32 master partitions, and the
write-back that gathers every rank's partition (``_gather.py``). The master gradient of a group
is the stage 2 / offload shard itself when it is fp32, else a transient fp32 copy (the own shards
of the flat buffer for stage 1, the whole buffer for stage 0); stages 1/2 take the norm over the
group (disjoint shards), stage 0 locally (the whole, identical on every rank after the reduction).

For stage 0 with fp32 parameters the master *is* the flat parameter buffer and its gradient the
flat gradient buffer (no copies, as plain DDP). Any optimizer whose update is elementwise works
(Adam, AdamW, SGD, Lion, ...); per-tensor rules (LAMB's trust ratio, Adafactor) would see a flat
partition instead of tensors, as in DeepSpeed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeGuard

import torch
import torch.distributed as dist
import torch.optim.optimizer as torch_optimizer_module

import ds_comm
import ds_optim
from ds_optim import global_grad_norm
from ds_zero._checkpoint import FORMAT, resolve_states
from ds_zero._core import GradientCore
from ds_zero._gather import gather_partition
from ds_zero._layout import FlatGroup, build_layout
from ds_zero._offload import (
    StateSwap,
    accepts_fp16_param_groups,
    default_swapper,
    host_zeros,
    upload_cast,
)
from ds_zero._param_access import register_param_owner
from ds_zero._reduce import GradReducer, ReduceContext
from ds_zero._shards import ShardLookup, TensorShard
from ds_zero._zero_shards import zero_checkpoint_shards, zero_load_checkpoint_shards
from ds_zero.api import MemoryBreakdown, TensorSwapper, ZeroConfig

__all__ = ["ZeroOptimizer"]

# DeepSpeed's communication_data_type names.
_COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _dp_rank_and_size(group: Any) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a process group was given but torch.distributed is not initialised")
        return 0, 1
    return ds_comm.get_rank(group), ds_comm.get_world_size(group)


def dist_rank() -> int:
    """This process's global rank (0 without a process group): names per-rank files."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _trainable_groups(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> list[list[torch.nn.Parameter]]:
    """Each optimizer group's trainable parameters, checked against the model."""
    in_model = {id(p) for p in model.parameters()}
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    missing = [
        n for n, p in model.named_parameters() if p.requires_grad and id(p) not in in_optimizer
    ]
    if missing:
        raise ValueError(
            f"trainable parameters missing from the optimizer: {missing[:5]}; pass all of "
            "model.parameters() to it, or set requires_grad=False on the ones to freeze"
        )
    if in_optimizer - in_model:
        raise ValueError("the optimizer holds parameters that are not in the model")
    groups = [[p for p in g["params"] if p.requires_grad] for g in optimizer.param_groups]
    kinds = {(p.dtype, p.device) for g in groups for p in g}
    if not kinds:
        raise ValueError("the model has no trainable parameters")
    if len(kinds) > 1:
        raise ValueError(
            f"trainable parameters must share one dtype and device, got {sorted(map(str, kinds))};"
            " cast the model first (e.g. model.to(torch.bfloat16))"
        )
    dtype = next(iter(kinds))[0]
    if not dtype.is_floating_point:
        raise ValueError(f"parameters of dtype {dtype} cannot be trained")
    return groups


class ZeroOptimizer(GradientCore):
    """ZeRO stage 0/1/2 around ``model`` and ``optimizer`` over a data-parallel group.

    The model's trainable parameters become views into flat per-group buffers, the optimizer's
    param groups are re-pointed at flat fp32 master partitions (their hyper-parameters, and any
    LR scheduler holding the optimizer, keep working), and the initial parameters are broadcast
    from the group's first rank. See [Note: one step].

    Args:
        model: the module (its parameters in one dtype: fp32, bf16 or fp16, on one device).
        optimizer: a ``torch.optim`` optimizer over the model's trainable parameters, without
            state yet; with ``offload_optimizer`` ds-optim's ``CPUAdam`` is the fast choice.
        config: the ``zero_optimization`` section (default: stage 0).
        group: the data-parallel process group (None: the default group, or a single process
            when ``torch.distributed`` is not initialised).
        loss_scaler: ds-optim's ``DynamicLossScaler``/``StaticLossScaler`` for fp16 (anything
            with ``loss_scale``, ``update_scale(overflow)``, ``state_dict``/``load_state_dict``).
        gradient_accumulation_steps: micro-batches per optimizer step; ``backward`` divides the
            loss by it.
        gradient_clipping: max global gradient norm (0: no clipping).
        swapper: where optimizer state goes with ``offload_optimizer.device="nvme"``
            (default: ds-offload-aio's ``AsyncTensorSwapper`` with default ``aio`` settings).
        param_group_process_groups: one entry per optimizer param group: the process group
            that group is reduced and sharded over, a subgroup of ``group`` (None: ``group``).
            MoE expert groups pass their expert-data-parallel group; gradients are still
            divided by ``group``'s size (see [Note: param groups with their own process group]).
        gradient_predivide_factor: DeepSpeed's key: gradients are divided by it before the sum
            and the sum multiplied by ``factor / world_size`` after it (None: the world size,
            i.e. all of the averaging before the sum, as DeepSpeed's ``prescale_gradients``).
        communication_data_type: dtype the gradient collectives run in (``torch.float32``,
            ``float16``, ``bfloat16`` or DeepSpeed's ``"fp32"``/``"fp16"``/``"bf16"``; None: the
            gradients' dtype); the result is cast back into the gradient storage.
        norm_group: a further process group over which the squared gradient norm is summed:
            the pipeline (or model-parallel) group, whose ranks hold different parameters, so
            that clipping and overflow skips use the norm of the whole model on every rank.
        norm_exclude: parameters left out of this rank's share of the norm because another
            rank of ``norm_group`` counts them (a pipeline's tied embedding held by two stages).

    Example:
        >>> zero = ZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
        ...                      ZeroConfig(stage=2, overlap_comm=True), group=dp_group)
        >>> for batch in loader:
        ...     zero.backward(loss_fn(model(batch)))
        ...     zero.step()
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
        swapper: TensorSwapper | None = None,
        param_group_process_groups: Sequence[Any] | None = None,
        gradient_predivide_factor: float | None = None,
        communication_data_type: torch.dtype | str | None = None,
        norm_group: Any = None,
        norm_exclude: Sequence[torch.nn.Parameter] = (),
    ) -> None:
        self.config = config if config is not None else ZeroConfig()
        comm_dtype = check_step_options(
            gradient_accumulation_steps,
            gradient_clipping,
            gradient_predivide_factor,
            communication_data_type,
        )
        offload = self.config.offload_optimizer
        self.module, self.optimizer, self.group = model, optimizer, group
        self.loss_scaler = loss_scaler
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.gradient_clipping = float(gradient_clipping)
        self.rank, self.world_size = _dp_rank_and_size(group)
        self.num_shards = self.world_size if self.config.shard_optimizer_state else 1
        self.shard_rank = self.rank if self.num_shards > 1 else 0  # whose slice of each unit
        trainable = _trainable_groups(model, optimizer)
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
        self._init_core()
        register_param_owner(self, (p for g in self.groups for p in g.params))

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

    def _master_from_params(self, group: FlatGroup, master: torch.Tensor) -> None:
        for unit in group.units:
            unit.in_partition(master).copy_(unit.shard(group.flat, self._shard_rank(group)))

    def _rewire_optimizer(self, trainable: Sequence[Sequence[torch.nn.Parameter]]) -> None:
        if self.optimizer.state:
            raise ValueError(
                "the optimizer already has state; wrap it before its first step (restore "
                "checkpoints with ZeroOptimizer.load_state_dict)"
            )
        masters = iter(self.masters)
        for index, param_group in enumerate(self.optimizer.param_groups):
            param_group["params"] = [next(masters)] if trainable[index] else []

    # --- backward and step -----------------------------------------------------------------------

    # --- the layout the core drives (see _core.py's [Note: one step]) ----------------------------

    def _master_grads(self) -> list[torch.Tensor]:
        grads = [self._master_grad(g) for g in self.groups]
        self.reducer.release_low_precision()  # the fp32 copies above are all the step needs
        return grads

    def _global_norm(self, grads: Sequence[torch.Tensor]) -> float:
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

    def _apply(self, grads: Sequence[torch.Tensor]) -> None:
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

    def refresh_fp32_params(self) -> None:
        """Rebuild the fp32 master partitions from the model's parameters (DeepSpeed's name),
        e.g. after loading module weights without optimizer state."""
        if self._master_is_flat:
            return
        with torch.no_grad():
            for group, master in zip(self.groups, self.masters):
                self._master_from_params(group, master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero every gradient (buffers are kept; ``set_to_none`` is accepted for torch parity)."""
        del set_to_none
        self.reducer.zero()

    # --- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's sharded state: its master partition, optimizer state and the layout.

        Save it per rank (or use :func:`~ds_zero.save_sharded_checkpoint`); the list of every
        rank's state loads on any world size (see [Note: resharding a checkpoint]).
        """
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
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            "counters": self._counters(),
        }

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Restore from this rank's :meth:`state_dict`, or from every saved rank's (any world
        size, with ``elastic_checkpoint``).

        With ``load_from_fp32_weights`` the model's parameters are rebuilt from the saved fp32
        masters; otherwise the masters are rebuilt from the model's current parameters (load the
        model's weights first).
        """
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
        if self.loss_scaler is not None and source.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(source["loss_scaler"])
        self._load_counters(source.get("counters", {}))
        self.reducer.zero()

    def checkpoint_shards(self) -> list[TensorShard]:
        """What this rank holds, per parameter range, for a universal checkpoint (see
        [Note: tensor shards of the flat layout])."""
        return zero_checkpoint_shards(self)

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


# [Note: stepping a flat master in slices]
# On CPU, torch's optimizers (unfused) and ds-optim's FusedAdam and Lion (``torch._foreach_*``)
# run one kernel per operation over a whole tensor, several of which allocate a temporary as
# large as it (Adam's ``exp_avg_sq.sqrt()`` and the division after it). For a flat master of
# 100M fp32 elements each is 400 MB, which glibc maps fresh from the kernel (above 32 MB it
# always does): every step page-faults through it, and each operation streams the whole buffer
# through memory. A DDP loop steps per parameter, with smaller temporaries and some cache reuse;
# the whole flat step was 1.5x slower (tools/bench/engine.py's AdamW: ~660 against ~440 ms).
# So on CPU the wrapped optimizer steps consecutive slices of ``STEP_SLICE_NUMEL`` elements of
# every group's master: each param group holds one slice at a time, whose gradient and
# elementwise state (tensors shaped like the master) are views into the flat tensors, updated
# in place, and whose scalar state (Adam's ``step``) is a copy of the value before the step;
# every slice advances it the same way and the first slice's result is kept. The update is
# elementwise, so the result is exactly the whole step's (tested bit for bit) and the state
# dict keeps one flat tensor per group. Only optimizers known to be elementwise are sliced
# (``_SLICEABLE``, exact types: a subclass may add a per-tensor rule), never their fused
# kernels (one pass, no temporaries), nor the first step (it creates the state, flat), nor an
# optimizer with step hooks (a hook means "once per step"; it would run once per slice).
# 2**17 to 2**18 elements (0.5-1 MiB of fp32: in a core's L2 cache with their state) measured
# fastest: AdamW over 100M elements took ~0.35 s against ~0.6 s whole (2**16: 0.40 s, 2**20:
# 0.47 s), FusedAdam 0.31 s against 0.44 s.

# That was 2 threads. Each elementwise op splits its slice among the intra-op threads, so with
# more threads a slice of that size leaves each thread too little to amortise the op's launch:
# the slice grows with the threads beyond 2 (``step_slice_numel``), keeping each thread's share.
STEP_SLICE_NUMEL = 1 << 18


def step_slice_numel() -> int:
    """Elements per optimizer slice for this process's intra-op thread count."""
    return STEP_SLICE_NUMEL * max(1, torch.get_num_threads() // 2)


_SLICEABLE = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.RMSprop,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adadelta,
    ds_optim.FusedAdam,
    ds_optim.Lion,
)


def _sliceable_masters(
    optimizer: torch.optim.Optimizer, numel: int
) -> list[torch.Tensor | None] | None:
    """Each param group's master (None for an empty group) when the step can be sliced, else
    None (see [Note: stepping a flat master in slices])."""
    if type(optimizer) not in _SLICEABLE or _has_step_hooks(optimizer):
        return None
    masters: list[torch.Tensor | None] = []
    for group in optimizer.param_groups:
        params = group["params"]
        if not params:
            masters.append(None)
            continue
        master = params[0]
        state = optimizer.state.get(master)
        if (
            len(params) != 1
            or group.get("fused")
            or group.get("differentiable")
            or master.device.type != "cpu"
            or master.dim() != 1
            or master.grad is None
            or not state  # the first step creates the state
            or any(_elementwise(v) and v.shape != master.shape for v in state.values())
        ):
            return None
        masters.append(master)
    longest = max((m.numel() for m in masters if m is not None), default=0)
    return masters if longest > numel else None


def step_in_slices(optimizer: torch.optim.Optimizer, numel: int = STEP_SLICE_NUMEL) -> bool:
    """Step ``optimizer`` over slices of ``numel`` elements of each group's flat master, when
    it can be (see [Note: stepping a flat master in slices]); return whether it did.

    Example:
        >>> if not step_in_slices(optimizer):  # param groups of one flat CPU master each
        ...     optimizer.step()
    """
    masters = _sliceable_masters(optimizer, numel)
    if masters is None:
        return False
    groups, state = optimizer.param_groups, optimizer.state
    before = {id(m): dict(state[m]) for m in masters if m is not None}
    first: dict[int, dict[str, Any]] = {}  # scalar state of each master's first slice
    grown: dict[tuple[int, str], list[torch.Tensor]] = {}  # elementwise state the step added
    live: list[torch.Tensor] = []
    longest = max(m.numel() for m in masters if m is not None)
    try:
        for start in range(0, longest, numel):
            stepped = []
            for group, master in zip(groups, masters):
                group["params"] = []
                if master is None or start >= master.numel():
                    continue
                length = min(numel, master.numel() - start)
                piece, grad = master.narrow(0, start, length), master.grad
                assert grad is not None  # checked by _sliceable_masters
                piece.grad = grad.narrow(0, start, length)
                state[piece] = {
                    k: v.narrow(0, start, length) if _elementwise(v) else _copy(v)
                    for k, v in before[id(master)].items()
                }
                group["params"] = [piece]
                live.append(piece)
                stepped.append((master, piece, start, length))
            optimizer.step()
            for master, piece, start, length in stepped:
                for key, value in state.pop(piece).items():
                    kept = before[id(master)].get(key)
                    if _elementwise(kept):
                        target = kept.narrow(0, start, length)
                        if value.data_ptr() != target.data_ptr():  # replaced, not updated
                            target.copy_(value)
                    elif _elementwise(value):
                        grown.setdefault((id(master), key), []).append(value)
                    elif start == 0:
                        first.setdefault(id(master), {})[key] = value
    finally:
        for group, master in zip(groups, masters):
            group["params"] = [master] if master is not None else []
        for piece in live:
            state.pop(piece, None)
    for master in masters:
        if master is not None:
            state[master].update(first.get(id(master), {}))
            for (owner, key), pieces in grown.items():
                if owner == id(master):
                    state[master][key] = torch.cat(pieces)
    return True


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    return bool(
        getattr(optimizer, "_optimizer_step_pre_hooks", None)
        or getattr(optimizer, "_optimizer_step_post_hooks", None)
        # torch's process-wide hooks (private names: read defensively, absent means none)
        or getattr(torch_optimizer_module, "_global_optimizer_pre_hooks", None)
        or getattr(torch_optimizer_module, "_global_optimizer_post_hooks", None)
    )


def _elementwise(value: Any) -> TypeGuard[torch.Tensor]:
    return torch.is_tensor(value) and value.dim() > 0


def _copy(value: Any) -> Any:
    return value.clone() if torch.is_tensor(value) else value


def check_step_options(
    accumulation: int,
    clipping: float,
    predivide: float | None,
    communication_data_type: torch.dtype | str | None,
) -> torch.dtype | None:
    """Validate the options every ZeRO optimizer takes; return the communication dtype."""
    if predivide is not None and not (0 < predivide < math.inf):
        raise ValueError(
            f"gradient_predivide_factor = {predivide}: expected a finite number > 0 (or None: "
            "divide by the world size before the sum)"
        )
    if accumulation < 1:
        raise ValueError(f"gradient_accumulation_steps = {accumulation}: expected >= 1")
    if not clipping >= 0:
        raise ValueError(f"gradient_clipping = {clipping}: expected >= 0")
    comm_dtype = _COMM_DTYPES.get(communication_data_type, communication_data_type)  # type: ignore[arg-type]
    if comm_dtype not in (None, *_COMM_DTYPES.values()):
        raise ValueError(
            f"communication_data_type = {communication_data_type!r}: expected one of "
            f"{list(_COMM_DTYPES)}, a matching torch dtype, or None (the gradients' dtype)"
        )
    return comm_dtype  # type: ignore[return-value]


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
        rank, size = _dp_rank_and_size(pg)
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
