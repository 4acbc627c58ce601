"""``Stage3Optimizer``: ZeRO stage 3 training: the step core (``_core.py``, [Note: one step])
set up with the per-parameter-shard layout (``_shard_layout.py``: gradients reduce-scattered
straight into this rank's fp32 shard, the wrapped optimizer stepping only that shard) and the
partitioned residency (``_residency.py``: parameters partitioned, gathered around each module by
``_stage3.py``'s hooks and released after).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ds_zero._core import GradientCore
from ds_zero._manifest import shard_destinations
from ds_zero._mics import MicsGroups
from ds_zero._param_access import register_param_owner
from ds_zero._partitioned import ParamPartitioner
from ds_zero._residency import PartitionedResidency
from ds_zero._setup import check_step_options, dp_rank_and_size
from ds_zero._shard_layout import ShardLayout
from ds_zero._shards import ShardLookup, TensorShard
from ds_zero._stage3 import PrefetchStats, Stage3Hooks
from ds_zero.api import MemoryBreakdown, TensorSwapper, ZeroConfig

__all__ = ["Stage3Optimizer"]

logger = logging.getLogger("ds_zero")


class Stage3Optimizer(GradientCore):
    """ZeRO stage 3 around ``model`` and ``optimizer`` over a data-parallel group: the step core
    (``_core.py``, [Note: one step]) with the per-parameter-shard layout
    (:class:`~ds_zero._shard_layout.ShardLayout`, ``_shard_layout.py``'s [Note: stage 3 step])
    and partitioned parameters (:class:`~ds_zero._residency.PartitionedResidency`); the same
    interface as :class:`~ds_zero.ZeroOptimizer`.

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
            ``_shard_layout.py``'s [Note: ZeRO-Infinity sub-group pipeline].
        norm_group: as :class:`~ds_zero.ZeroOptimizer`: a further group (pipeline or model
            parallel) over which the squared gradient norm is summed.
        norm_exclude: as :class:`~ds_zero.ZeroOptimizer`: parameters another rank of
            ``norm_group`` counts in the norm.
        param_group_process_groups: one entry per optimizer param group: the subgroup of
            ``group`` its parameters are partitioned and reduced over (MoE experts: their
            expert-data-parallel group), None for ``group``; see ``_shard_layout.py``'s [Note:
            stage 3 param groups with their own process group].
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
        config = config if config is not None else ZeroConfig(stage=3)
        if not config.shard_parameters:
            raise ValueError(
                f"zero_optimization.stage = {config.stage}: Stage3Optimizer needs stage 3; "
                "use ZeroOptimizer (or ds_zero.build_zero_optimizer) for stages 0-2"
            )
        comm_dtype = check_step_options(
            gradient_accumulation_steps,
            gradient_clipping,
            gradient_predivide_factor,
            communication_data_type,
        )
        mics = MicsGroups.build(config, group)  # [Note: MiCS]: over its shard group
        group = group if mics is None else mics.shard_group
        rank, world_size = dp_rank_and_size(group)
        residency = PartitionedResidency(
            model,
            optimizer,
            config,
            group=group,
            rank=rank,
            world_size=world_size,
            partitioner=partitioner,
            mics=mics,
            param_group_process_groups=param_group_process_groups,
        )
        layout = ShardLayout(
            model,
            optimizer,
            config,
            residency,
            group=group,
            rank=rank,
            world_size=world_size,
            mics=mics,
            swapper=swapper,
            gradient_predivide_factor=gradient_predivide_factor,
            comm_dtype=comm_dtype,
            norm_group=norm_group,
            norm_exclude=norm_exclude,
            checkpoint_names=checkpoint_names,
        )
        super().__init__(
            layout,
            residency,
            optimizer=optimizer,
            loss_scaler=loss_scaler,
            gradient_accumulation_steps=gradient_accumulation_steps,
            gradient_clipping=gradient_clipping,
        )
        self.layout: ShardLayout = layout
        self.partitioned: PartitionedResidency = residency
        # the strategies' attributes, under the names this class has always had
        self.config = config
        self.module = model
        self.mics = mics  # [Note: MiCS]: over its shard group
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.partitioner = residency.partitioner
        self.names = layout.names
        self.trainable = layout.trainable
        self.masters = layout.masters
        self.norm_group = norm_group
        self.queue = layout.queue
        self._slots = layout._slots
        self._swap = layout._swap
        self._fused_copy = layout._fused_copy
        register_param_owner(layout, layout._slots_params())
        host = layout.host_memory()
        if host:
            logger.info(
                "ZeRO-3 offload (optimizer: %s, parameters: %s): %.1f MiB of host memory on "
                "this rank (%s)",
                config.offload_optimizer.device,
                config.offload_param.device,
                sum(host.values()) / 2**20,
                ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in host.items()),
            )

    @property
    def grad_shards(self) -> list[torch.Tensor | None]:
        """The fp32 gradient shards, one per master sub-group (None between steps)."""
        return self.layout.grad_shards

    @property
    def hooks(self) -> Stage3Hooks:
        """The partitioned residency's module hooks (gather/release around each module)."""
        return self.partitioned.hooks

    @property
    def prefetch_stats(self) -> PrefetchStats:
        """Prefetch hits, misses and trace invalidations so far."""
        return self.partitioned.stats

    def destroy(self) -> None:
        """Remove the module and gradient hooks (DeepSpeed's name); the parameters stay
        partitioned."""
        self.residency.remove()
        self.layout.reducer.remove_hooks()

    def refresh_fp32_params(self) -> None:
        """Rebuild the fp32 masters from the parameter shards (DeepSpeed's name)."""
        self.layout.refresh_fp32_params()

    # --- the layout's state, checkpoint shards and memory ----------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: its fp32 masters and optimizer state (same world size to load;
        use :meth:`checkpoint_shards` for a reshardable checkpoint)."""
        return {**self.layout.state_dict(), **self._core_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from this rank's :meth:`state_dict`."""
        self._load_core_state(self.layout.load_state_dict(state))

    def checkpoint_shards(self) -> list[TensorShard]:
        """This rank's piece of every parameter and of its elementwise optimizer state (see
        ``_shards.py``'s [Note: tensor shards]); persistent parameters report their r-th slice
        too, so every element is covered exactly once."""
        return self.layout.checkpoint_shards()

    def shard_destinations(
        self, folder: str | os.PathLike[str]
    ) -> dict[str, dict[str, torch.Tensor]]:
        """As :meth:`ZeroOptimizer.shard_destinations <ds_zero.ZeroOptimizer.shard_destinations>`:
        where a full load may copy this rank's pieces as they are hashed (empty where they are
        not exactly this rank's ranges, or the manifest cannot be read)."""
        return shard_destinations(folder, self.layout)

    def load_checkpoint_shards(self, lookup: ShardLookup) -> None:
        """Fill this rank's masters, elementwise optimizer state and parameter shards from
        ``lookup`` (a checkpoint of any world size or stage).

        Scalar optimizer state (Adam's ``step``) is not in a lookup: it is kept when the
        optimizer has state already, else set to :attr:`global_steps`; the checkpoint reader
        restores the saved scalars after this call.
        """
        self.layout.load_checkpoint_shards(lookup, self.global_steps)

    def memory_breakdown(self) -> MemoryBreakdown:
        """Bytes this rank holds: ``params`` are the shards plus whole persistent parameters,
        ``grads`` the fp32 gradient shards from a backward to the step after it (freed
        between steps), ``buffers`` the peak gathered working set plus the largest reduction
        bucket, ``host`` what offload keeps in host memory (see :meth:`host_memory`)."""
        return self.layout.memory_breakdown()

    def host_memory(self) -> dict[str, int]:
        """Bytes this rank keeps in host memory because of offload, by kind (see
        :meth:`ShardLayout.host_memory <ds_zero._shard_layout.ShardLayout.host_memory>`).

        Example:
            >>> sum(zero.host_memory().values()) == zero.memory_breakdown().host
        """
        return self.layout.host_memory()

    def _optimizer_state_bytes(self) -> dict[str, int]:
        return self.layout._optimizer_state_bytes()
