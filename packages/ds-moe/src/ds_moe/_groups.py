"""Expert-parallel and expert-data-parallel process groups, built from a ds-comm topology.

[Note: expert group layout]
DeepSpeed lays the data-parallel ranks of each (pipeline stage, tensor slice) out as
``expert_data x expert``: by default (E + D) the expert-parallel groups are runs of ``ep_size``
consecutive data-parallel ranks and the expert-data-parallel groups stride by ``ep_size``; with
``use_data_before_expert_parallel_`` (D + E) it is the other way round. In ds-comm's rank order
(``rank = pipe * (dp * mp) + data * mp + model``, see [Note: rank order] in ds-comm) that is the
topology ``[pipe, expert_data, expert, model]`` (or ``[pipe, expert, expert_data, model]``) with
dims ``[pp, dp / ep, ep, mp]``, whose ``expert`` and ``expert_data`` axes give the groups. For
16 ranks, tensor parallel 2 and ``ep_size`` 4 this yields DeepSpeed's documented example:
expert-parallel ``[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], ...`` and expert-data-parallel
``[0, 8], [2, 10], ...``.

Dense parameters are reduced over the full data-parallel group, expert parameters only over
their expert-data-parallel group (the other ranks hold other experts), both divided by the
data-parallel size, as DeepSpeed's engine does, so the gradient is that of the mean loss over
the data-parallel batch whatever ``ep_size`` is.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ds_comm
from ds_comm import ConfigError, MpuProtocol, ParallelGrid, ParallelLayout, ProcessTopology
from ds_moe._layer import MoE
from ds_moe._params import is_moe_param
from ds_moe.api import ExpertGroup

__all__ = ["ExpertParallelGroups", "configure_expert_parallelism", "expert_topology"]


def expert_topology(
    world_size: int,
    ep_size: int,
    *,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    use_data_before_expert_parallel_: bool = False,
) -> ProcessTopology:
    """The rank layout with ``expert`` and ``expert_data`` axes; see [Note: expert group layout].

    Example:
        >>> topo = expert_topology(4, 2)
        >>> topo.get_axis_comm_lists("expert"), topo.get_axis_comm_lists("expert_data")
        ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    """
    model_pipe = tensor_parallel_size * pipeline_parallel_size
    if world_size % model_pipe:
        raise ConfigError(
            f"world size {world_size} is not divisible by tensor x pipeline parallel size "
            f"{tensor_parallel_size} x {pipeline_parallel_size}"
        )
    data_parallel = world_size // model_pipe
    if ep_size < 1 or data_parallel % ep_size:
        raise ConfigError(
            f"MoE ep_size = {ep_size} must divide the data-parallel size {data_parallel} "
            f"(world size {world_size} / tensor x pipeline parallel {model_pipe}); "
            f"choose an ep_size among the divisors of {data_parallel}"
        )
    inner = (
        ["expert", "expert_data"] if use_data_before_expert_parallel_ else ["expert_data", "expert"]
    )
    sizes = {"expert": ep_size, "expert_data": data_parallel // ep_size}
    return ProcessTopology(
        axes=["pipe", *inner, "model"],
        dims=[pipeline_parallel_size, *(sizes[a] for a in inner), tensor_parallel_size],
    )


class ExpertParallelGroups:
    """Registry of the process groups of a model's MoE layers, keyed by ``ep_size_<n>``.

    Holds the dense data-parallel group (the mpu's, or every rank without one) and one
    :class:`~ds_moe.ExpertGroup` per expert-parallel size. The model (or engine) owns it; nothing
    is global. Without an initialised default process group everything is single-process.

    Args:
        mpu: the model-parallel unit when tensor/pipeline parallelism is used (its data-parallel
            group and sizes set the layout); None for pure data parallelism.
        use_data_before_expert_parallel_: D + E instead of E + D layout.
        grid: a ds-comm :class:`~ds_comm.ParallelGrid`: the sizes, the data-parallel group and
            the rank arithmetic come from it, and ``add(grid's ep)`` reuses its ``ep``/``edp``
            groups instead of creating its own (other ep sizes get new groups laid out the
            same way). Exclusive with ``mpu`` and with the D + E layout.

    Example:
        >>> groups = ExpertParallelGroups()
        >>> group = groups.add(2)  # collective: every rank, same order
        >>> group.expert_parallel_ranks, group.expert_data_parallel_ranks  # rank 0 of 4
        ((0, 1), (0, 2))
    """

    def __init__(
        self,
        *,
        mpu: MpuProtocol | None = None,
        use_data_before_expert_parallel_: bool = False,
        grid: ParallelGrid | None = None,
    ) -> None:
        if grid is not None and (mpu is not None or use_data_before_expert_parallel_):
            raise ConfigError(
                "ExpertParallelGroups(grid=...) takes its sizes and layout from the grid: pass "
                "neither mpu= nor use_data_before_expert_parallel_=True with it (the grid lays "
                "experts out E + D, DeepSpeed's default)"
            )
        self.grid = grid
        if grid is not None:
            mpu = grid.mpu()
        self.distributed = ds_comm.is_initialized()
        self.rank = ds_comm.get_rank() if self.distributed else 0
        self.world_size = ds_comm.get_world_size() if self.distributed else 1
        self.use_data_before_expert_parallel_ = use_data_before_expert_parallel_
        self.tensor_parallel_size = 1 if mpu is None else mpu.get_model_parallel_world_size()
        self.model_parallel_rank = 0 if mpu is None else mpu.get_model_parallel_rank()
        data_parallel = self.world_size if mpu is None else mpu.get_data_parallel_world_size()
        self.pipeline_parallel_size = self.world_size // (self.tensor_parallel_size * data_parallel)
        if grid is not None:
            self.pipeline_parallel_size = grid.axis_world_size("pp")
        self.data_parallel_size = data_parallel
        self.data_parallel_rank = self.rank if mpu is None else mpu.get_data_parallel_rank()
        if mpu is not None:
            self.data_parallel_group: Any = mpu.get_data_parallel_group()
        else:
            self.data_parallel_group = dist.group.WORLD if self.distributed else None
        self._groups: dict[str, ExpertGroup] = {}

    def add(self, ep_size: int) -> ExpertGroup:
        """The groups of ``ep_size`` (collective the first time: every rank, same order)."""
        name = f"ep_size_{ep_size}"
        if name in self._groups:
            return self._groups[name]
        if self.grid is not None:
            group = self._add_from_grid(self.grid, name, ep_size)
            self._groups[name] = group
            return group
        topo = expert_topology(
            self.world_size,
            ep_size,
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            use_data_before_expert_parallel_=self.use_data_before_expert_parallel_,
        )
        ep_group, ep_ranks = self._new_groups(topo.get_axis_comm_lists("expert"))
        edp_group, edp_ranks = self._new_groups(topo.get_axis_comm_lists("expert_data"))
        group = ExpertGroup(
            name=name,
            ep_size=ep_size,
            rank=self.rank,
            expert_parallel_group=ep_group,
            expert_parallel_ranks=ep_ranks,
            expert_data_parallel_group=edp_group,
            expert_data_parallel_ranks=edp_ranks,
        )
        self._groups[name] = group
        return group

    def _add_from_grid(self, grid: ParallelGrid, name: str, ep_size: int) -> ExpertGroup:
        if ep_size == grid.axis_world_size("ep"):
            # The grid made these groups already (collectively); a group of one rank is None.
            mine = []
            for axis in ("ep", "edp"):
                ranks = tuple(grid.ranks_of(axis))
                mine.append((grid.get_group(axis) if len(ranks) > 1 else None, ranks))
        else:
            sizes = grid.layout.sizes
            try:
                layout = ParallelLayout(
                    self.world_size, **sizes, ep=ep_size, order=grid.layout.order
                )
            except ValueError as exc:
                raise ConfigError(f"MoE ep_size = {ep_size}: {exc}") from exc
            mine = [self._new_groups(layout.rank_lists(a)) for a in ("ep", "edp")]
        (ep_group, ep_ranks), (edp_group, edp_ranks) = mine
        return ExpertGroup(
            name=name,
            ep_size=ep_size,
            rank=self.rank,
            expert_parallel_group=ep_group,
            expert_parallel_ranks=ep_ranks,
            expert_data_parallel_group=edp_group,
            expert_data_parallel_ranks=edp_ranks,
        )

    def _new_groups(self, rank_lists: list[list[int]]) -> tuple[Any, tuple[int, ...]]:
        mine: tuple[Any, tuple[int, ...]] = (None, (self.rank,))
        for ranks in rank_lists:
            # Every rank creates every group, in the same order (torch's rule). A group of one
            # rank has nothing to communicate: None (ep_size=1 would otherwise create one group
            # per rank).
            group = ds_comm.new_group(ranks) if self.distributed and len(ranks) > 1 else None
            if self.rank in ranks:
                mine = (group, tuple(ranks))
        return mine

    def __getitem__(self, name: str) -> ExpertGroup:
        if name not in self._groups:
            raise KeyError(
                f"no expert group {name!r}; this registry has {sorted(self._groups)}: call "
                f"add(ep_size) or configure_expert_parallelism(model) first"
            )
        return self._groups[name]

    def __contains__(self, name: object) -> bool:
        return name in self._groups

    def __iter__(self) -> Iterator[ExpertGroup]:
        return iter(self._groups.values())


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """The model's MoE layers with their module names, in ``named_modules`` order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def configure_expert_parallelism(
    model: nn.Module,
    *,
    mpu: MpuProtocol | None = None,
    use_data_before_expert_parallel_: bool = False,
    groups: ExpertParallelGroups | None = None,
) -> ExpertParallelGroups:
    """Create the process groups of every MoE layer in ``model`` and hand them to the layers.

    Collective: every rank calls it with the same model structure. This is what DeepSpeed's
    engine does with ``MoE.set_deepspeed_parallelism()``; ds-engine calls it for you.

    Args:
        model: a module containing :class:`~ds_moe.MoE` layers (any ``ep_size`` mix).
        mpu: the model-parallel unit, if any.
        use_data_before_expert_parallel_: D + E layout; see [Note: expert group layout].
        groups: an existing registry to add to (its mpu and layout are kept).

    Returns:
        The registry, for gradient reduction and checkpointing.

    Example:
        >>> groups = ds_moe.configure_expert_parallelism(model)
        >>> loss.backward()
        >>> ds_moe.all_reduce_gradients(model, groups)
    """
    if groups is None:
        groups = ExpertParallelGroups(
            mpu=mpu, use_data_before_expert_parallel_=use_data_before_expert_parallel_
        )
    layers = moe_layers(model)
    for ep_size in sorted({layer.ep_size for _, layer in layers}):
        groups.add(ep_size)
    for _, layer in layers:
        layer.set_expert_group(groups[layer.expert_group_name])
    return groups


def _all_reduce_mean(grads: list[torch.Tensor], group: Any, world: int, divide_by: int) -> None:
    if not grads:
        return
    for bucket in ds_comm.flatten_into_buckets(grads, 32 * 2**20):
        if world > 1:
            ds_comm.all_reduce(bucket.buffer, group=group)
        bucket.buffer.div_(divide_by)
        bucket.copy_back()


def all_reduce_gradients(model: nn.Module, groups: ExpertParallelGroups) -> None:
    """Average gradients over data parallelism: dense over the data-parallel group, expert
    parameters over their expert-data-parallel group; see [Note: expert group layout].

    Collective over the data-parallel group. Parameters that require grad but have none get
    zeros first, so every rank reduces the same buffers. ds-engine and ds-zero do this
    themselves; this is for training without them.
    """
    dense: list[torch.Tensor] = []
    experts: dict[str, list[torch.Tensor]] = {}
    for param in model.parameters():
        if not param.requires_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        if is_moe_param(param):
            experts.setdefault(param.group_name, []).append(param.grad)  # type: ignore[attr-defined]
        else:
            dense.append(param.grad)
    size = groups.data_parallel_size
    _all_reduce_mean(dense, groups.data_parallel_group, size, size)
    for name in sorted(experts):
        group = groups[name]
        world = len(group.expert_data_parallel_ranks)
        _all_reduce_mean(experts[name], group.expert_data_parallel_group, world, size)
