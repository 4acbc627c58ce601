"""Parameter residency: where the model's parameters live between their uses, one of the two
strategies of the gradient-step core (``_core.py``, [Note: one step]).

[Note: parameter residency]
A residency answers what the step core asks about parameters, never about gradients:

- ``end_iteration()``: after every backward (also a failed one);
- ``release(p)``: ``p``'s gradient was taken (its reduction is queued): the parameter may go;
- ``before_publish()`` / ``after_publish(params)``: around the layout's write of the stepped
  masters into the parameters;
- ``remove()``: the optimizer is destroyed;
- ``working_bytes``: the peak of gathered parameters (memory accounting).

:class:`WholeResidency` (stages 0-2): every rank holds every parameter whole, so all of it is
a no-op. :class:`PartitionedResidency` (stage 3, ``ZeroConfig.shard_parameters``): each rank
holds a shard (``_partitioned.py``): the residency partitions the model at construction
(broadcasting from the group's first rank whatever ``ds_zero.Init`` did not partition; param
groups with their own process group over that group), then
:class:`~ds_zero._stage3.Stage3Hooks` gather a module's
parameters around its forward and backward and release them after, and prefetch along the
trace that ``end_iteration`` closes; a parameter is released again once its gradient is taken;
ZeRO++ hpZ's secondary copies are dropped before a publish (they hold the old values) and the
persistent parameters (``stage3_param_persistence_threshold``) are gathered whole after it.
"""

# DeepSpeed's ZeRO-3 parameter attributes (p.ds_persist, ...) are set on torch Parameters at
# run time, which the type checker cannot see.
# pyright: reportAttributeAccessIssue=false

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

from ds_zero._mics import MicsGroups
from ds_zero._partitioned import ParamPartitioner
from ds_zero._stage3 import PrefetchStats, Stage3Hooks
from ds_zero._zeropp import build_weight_comm
from ds_zero.api import ZeroConfig

__all__ = ["PartitionedResidency", "Residency", "WholeResidency"]


class Residency(Protocol):
    """Where parameters live between uses (see [Note: parameter residency])."""

    def end_iteration(self) -> None:
        """After every backward (also a failed one)."""
        ...

    def release(self, param: torch.nn.Parameter) -> None:
        """``param``'s gradient was taken: it is not needed until its next use."""
        ...

    def before_publish(self) -> None:
        """The masters are about to be written into the parameters."""
        ...

    def after_publish(self, params: Iterable[torch.nn.Parameter]) -> None:
        """The masters of ``params`` were written into them."""
        ...

    def remove(self) -> None:
        """Remove whatever the residency installed on the model."""
        ...

    @property
    def working_bytes(self) -> int:
        """Peak bytes of parameters gathered beyond what this rank holds."""
        ...


class WholeResidency:
    """Every rank holds every parameter whole (stages 0-2): nothing to gather or release."""

    def end_iteration(self) -> None:
        """Nothing to end."""

    def release(self, param: torch.nn.Parameter) -> None:
        """Kept: the parameter is this rank's."""
        del param

    def before_publish(self) -> None:
        """Nothing to drop."""

    def after_publish(self, params: Iterable[torch.nn.Parameter]) -> None:
        """The publish wrote the parameters whole already."""
        del params

    def remove(self) -> None:
        """Nothing installed."""

    @property
    def working_bytes(self) -> int:
        """Nothing is gathered."""
        return 0


class PartitionedResidency:
    """Each rank holds a shard of every parameter; module hooks gather and release them (stage
    3, see [Note: parameter residency]).

    Parameters not yet partitioned (a model built outside ``ds_zero.Init``) are broadcast from
    the group's first rank and partitioned here.

    Args:
        model: the module.
        optimizer: the wrapped optimizer (its param groups name the parameters of each group).
        config: the ``zero_optimization`` section (prefetch, persistence, offload, ZeRO++).
        group: the group the parameters are partitioned over (MiCS: its shard group).
        rank: this rank's index in ``group``.
        world_size: ``group``'s size.
        partitioner: the partitioner that partitioned the model (None: the one of parameters
            already partitioned, else a new one built from ``config``).
        mics: MiCS's groups (its replicas start from the same values).
        param_group_process_groups: each optimizer param group's own process group, or None
            (see ``_shard_layout.py``'s [Note: stage 3 param groups with their own process
            group]).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: ZeroConfig,
        *,
        group: Any,
        rank: int,
        world_size: int,
        partitioner: ParamPartitioner | None = None,
        mics: MicsGroups | None = None,
        param_group_process_groups: Sequence[Any] | None = None,
    ) -> None:
        self.config, self.optimizer = config, optimizer
        self.group, self.rank, self.world_size = group, rank, world_size
        self.partitioner = partitioner or self._partitioner_of(model)
        if self.partitioner.world_size != world_size:
            raise ValueError(
                f"the partitioner spans {self.partitioner.world_size} ranks and the group "
                f"{world_size}; build both over the same data-parallel group"
            )
        named = list(model.named_parameters())
        self.own_groups = self._partition_own_groups(named, param_group_process_groups)
        if mics is not None:
            if self.own_groups:
                raise ValueError(
                    "mics_shard_size with param_group_process_groups (MoE experts) is not "
                    "implemented; remove one of them"
                )
            mics.broadcast(p for _, p in named)
        self.partitioner.partition(
            [p for _, p in named], names=[n for n, _ in named], broadcast_from=0
        )
        # ZeRO++ qwZ/hpZ: how the hooks' gathers travel (_zeropp.py's [Note: ZeRO++])
        self.partitioner.weight_comm = build_weight_comm(config, group, world_size)
        self.hooks = Stage3Hooks(
            model,
            self.partitioner,
            prefetch_bucket_size=config.stage3_prefetch_bucket_size,
            max_live_parameters=config.stage3_max_live_parameters,
            max_reuse_distance=config.stage3_max_reuse_distance,
        )

    def _partition_own_groups(
        self, named: Sequence[tuple[str, torch.nn.Parameter]], process_groups: Sequence[Any] | None
    ) -> dict[int, tuple[Any, int]]:
        """Partition the param groups that have their own process group over it (see [Note:
        stage 3 param groups with their own process group] in ``_shard_layout.py``); by
        parameter ``id``, its group and the group's size."""
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

    @property
    def stats(self) -> PrefetchStats:
        """Prefetch hits, misses and trace invalidations so far."""
        return self.hooks.stats

    def end_iteration(self) -> None:
        """End the prefetch trace of this forward/backward."""
        self.hooks.end_iteration()

    def release(self, param: torch.nn.Parameter) -> None:
        """Free ``param``'s gathered storage (its gradient hook fired)."""
        self.partitioner.release([param], free_storage=True)

    def before_publish(self) -> None:
        """ZeRO++ hpZ: the secondary copies hold the old values."""
        self.partitioner.drop_secondary()

    def after_publish(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Gather the persistent ones among ``params`` whole again."""
        self.partitioner.write_full_from_shards([p for p in params if p.ds_persist])

    def remove(self) -> None:
        """Remove the module hooks (the parameters stay partitioned)."""
        self.hooks.remove()

    @property
    def working_bytes(self) -> int:
        """The peak gathered working set so far."""
        params = self.partitioner.params
        itemsize = params[0].element_size() if params else 0
        return self.partitioner.peak_gathered_numel * itemsize
