"""Cartesian rank layouts (DeepSpeed's ``ProcessTopology``), the process groups of one rank's
axes (:class:`ProcessGrid`) and the mpu view other packages consume (:class:`Mpu`).

[Note: rank order]
Ranks enumerate the cartesian product of the axes in the order given, the first axis slowest
(row-major), as DeepSpeed does. ``PipeModelDataParallelTopology(num_pp, num_mp, num_dp)`` uses
axes ``['pipe', 'data', 'model']``, so ``rank = pipe * (dp * mp) + data * mp + model``: the
model-parallel peers of a rank are adjacent (same host, fastest links) and pipeline stages are
farthest apart.

[Note: model parallel means the 'model' axis]
DeepSpeed's own ``PipelineParallelGrid.get_model_parallel_*`` returns the group of every rank
holding one model replica (pipe x model). Megatron's mpu, which DeepSpeed's engine is written
against, means tensor slicing, and renamed it ``get_tensor_model_parallel_*``. :class:`Mpu`
follows Megatron: model parallel is the ``'model'`` axis alone, and the tensor names are aliases.
"""

from __future__ import annotations

import itertools
from collections import namedtuple
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch.distributed as dist

__all__ = [
    "Mpu",
    "MpuProtocol",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "ProcessGrid",
    "ProcessTopology",
]


class ProcessTopology:
    """Maps n-dimensional coordinates (one per named axis) to linear ranks and back.

    Args:
        axes: axis names, slowest-varying first, e.g. ``['pipe', 'data', 'model']``.
        dims: the size of each axis.

    Example:
        >>> topo = ProcessTopology(axes=["x", "y"], dims=[2, 3])
        >>> topo.get_rank(x=1, y=0), topo.get_coord(4)
        (3, ProcessCoord(x=1, y=1))
    """

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        if len(axes) != len(dims):
            raise ValueError(f"{len(axes)} axes {list(axes)} but {len(dims)} dims {list(dims)}")
        if len(set(axes)) != len(axes):
            raise ValueError(f"axis names must be distinct, got {list(axes)}")
        if any(int(d) < 1 for d in dims):
            raise ValueError(f"every dim must be >= 1, got {list(dims)}")
        self.axes = list(axes)
        self.dims = [int(d) for d in dims]
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)  # type: ignore[misc]
        self.mapping: dict[Any, int] = {}
        self._coords: list[Any] = []
        for rank, coord in enumerate(itertools.product(*(range(d) for d in self.dims))):
            key = self.ProcessCoord(*coord)
            self.mapping[key] = rank
            self._coords.append(key)

    def get_rank(self, **coord_kwargs: int) -> int:
        """The rank at a full coordinate, e.g. ``get_rank(pipe=1, data=0)``."""
        if len(coord_kwargs) != len(self.axes):
            raise ValueError("get_rank() does not support slices. Use filter_match())")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"coordinate {coord_kwargs} is outside dims {self.dims}")
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        """Axis names, slowest-varying first."""
        return self.axes

    def get_rank_repr(
        self,
        rank: int,
        omit_axes: Iterable[str] = ("data", "pipe"),
        inner_sep: str = "_",
        outer_sep: str = "-",
    ) -> str:
        """A name for ``rank`` from its coordinates, e.g. ``model_01`` (checkpoint file names).

        Data and pipe coordinates are omitted by default: data-parallel replicas share a file
        and pipeline stages name their layers separately.
        """
        omit = frozenset(omit_axes)
        coord = self.get_coord(rank)
        return outer_sep.join(
            f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes if axis not in omit
        )

    def get_dim(self, axis: str) -> int:
        """The size of ``axis``; 0 when the topology has no such axis (lets hybrid code ask)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank: int) -> Any:
        """The ``ProcessCoord`` namedtuple of ``rank``."""
        if not 0 <= rank < len(self._coords):
            raise ValueError(f"rank {rank} not found in topology of {len(self._coords)} ranks.")
        return self._coords[rank]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The rank lists that communicate along ``axis`` (all other coordinates fixed).

        Ordered by the other axes' coordinates, slowest first; empty for an unknown axis.

        Example:
            >>> PipeDataParallelTopology(num_pp=2, num_dp=2).get_axis_comm_lists("data")
            [[0, 1], [2, 3]]
        """
        if axis not in self.axes:
            return []
        other_axes = [a for a in self.axes if a != axis]
        lists = []
        for other in itertools.product(*(range(self.get_dim(a)) for a in other_axes)):
            fixed = dict(zip(other_axes, other))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """Ranks (ascending) whose coordinates match every given ``axis=value``."""
        return [
            rank
            for rank, coord in enumerate(self._coords)
            if all(getattr(coord, key) == value for key, value in filter_kwargs.items())
        ]

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Ranks (ascending) whose coordinate on ``axis`` is ``idx``."""
        position = self.axes.index(axis)
        return [rank for rank, coord in enumerate(self._coords) if coord[position] == idx]

    def world_size(self) -> int:
        """Number of ranks the topology spans (product of dims)."""
        return len(self._coords)

    def __str__(self) -> str:
        return str(self.mapping)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(axes={self.axes}, dims={self.dims})"


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism: axes ``['pipe', 'data']``."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x model parallelism: axes ``['pipe', 'data', 'model']``.

    Note the argument order (pipe, model, data) differs from the axis order; see
    [Note: rank order].
    """

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


GroupFactory = Callable[..., Any]
# Axes the mpu protocol asks about; a topology without one gets singleton groups for it.
_MPU_AXES = ("pipe", "data", "model")


class ProcessGrid:
    """This rank's place in a topology and the process group of each of its axes.

    Constructing it is collective: every rank of the default group must construct the same grid,
    because each group is created (``group_factory(ranks=...)``) on every rank in the same order,
    members or not. A topology whose axes are DeepSpeed's ``pipe``/``data``/``model`` (every
    pipeline's) takes its groups from the :class:`~ds_comm.ParallelGrid` of the same layout
    (:attr:`parallel_grid`), so the pipeline, tensor, sequence and expert features share one set
    of groups; an axis the topology lacks gets the grid's singleton groups, as DeepSpeed's grid
    does for model parallelism of 1. A topology with other axis names (a generic cartesian
    layout, e.g. ``['expert', 'data']``) gets one group per axis from its own comm lists.

    Args:
        topology: the rank layout; its world size must equal the default group's.
        group_factory: creates one group from ``ranks=``; ``torch.distributed.new_group``.

    Example:
        >>> grid = ProcessGrid(PipeDataParallelTopology(num_pp=2, num_dp=2))
        >>> dist.all_reduce(grads, group=grid.get_group("data"))
    """

    def __init__(self, topology: ProcessTopology, group_factory: GroupFactory = dist.new_group):
        world_size = dist.get_world_size()
        if topology.world_size() != world_size:
            raise ValueError(
                f"{topology!r} spans {topology.world_size()} ranks but the default group has "
                f"{world_size}; choose dims whose product is {world_size}"
            )
        self.topology = topology
        self.rank = dist.get_rank()
        self._coord = topology.get_coord(self.rank)
        self._groups: dict[str, Any] = {}
        self._ranks: dict[str, list[int]] = {}
        #: The ParallelGrid the groups come from (None for a topology with non-grid axes).
        self.parallel_grid: Any = None
        if all(axis in _MPU_AXES for axis in topology.axes):
            self._groups_from_parallel_grid(group_factory)
        else:
            self._groups_per_axis(group_factory)

    def _groups_from_parallel_grid(self, group_factory: GroupFactory) -> None:
        from ds_comm._grid import DEEPSPEED_AXES, ParallelGrid  # _grid imports this module

        grid = ParallelGrid.from_topology(self.topology, group_factory=group_factory)
        self.parallel_grid = grid
        for axis in _MPU_AXES:
            self._groups[axis] = grid.get_group(DEEPSPEED_AXES[axis])
            self._ranks[axis] = grid.ranks_of(DEEPSPEED_AXES[axis])

    def _groups_per_axis(self, group_factory: GroupFactory) -> None:
        singleton_lists = [[r] for r in range(self.topology.world_size())]
        axes = [*self.topology.axes, *(a for a in _MPU_AXES if a not in self.topology.axes)]
        for axis in axes:
            lists = self.topology.get_axis_comm_lists(axis) or singleton_lists
            for ranks in lists:
                group = group_factory(ranks=ranks)
                if self.rank in ranks:
                    self._groups[axis] = group
                    self._ranks[axis] = ranks

    def get_group(self, axis: str) -> Any:
        """The process group of this rank's peers along ``axis``."""
        if axis not in self._groups:
            raise KeyError(f"no group for axis {axis!r}; this grid has {sorted(self._groups)}")
        return self._groups[axis]

    def get_ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along ``axis``, in axis order."""
        if axis not in self._ranks:
            raise KeyError(f"no group for axis {axis!r}; this grid has {sorted(self._ranks)}")
        return self._ranks[axis]

    def get_coord(self) -> Any:
        """This rank's ``ProcessCoord``."""
        return self._coord

    def axis_rank(self, axis: str) -> int:
        """This rank's coordinate along ``axis`` (0 for an axis the topology lacks)."""
        return getattr(self._coord, axis) if axis in self.topology.axes else 0

    def axis_world_size(self, axis: str) -> int:
        """The size of ``axis`` (1 for an axis the topology lacks)."""
        return max(self.topology.get_dim(axis), 1)

    @property
    def stage_id(self) -> int:
        """This rank's pipeline stage."""
        return self.axis_rank("pipe")

    @property
    def num_stages(self) -> int:
        return self.axis_world_size("pipe")

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def stage_to_global(self, stage_id: int, **coords: int) -> int:
        """Global rank of ``stage_id`` with this rank's other coordinates (or ``coords``)."""
        if "pipe" not in self.topology.axes:
            if stage_id != 0:
                raise ValueError(f"stage {stage_id} requested but the topology has no 'pipe' axis")
            return self.topology.get_rank(**{**self._coord._asdict(), **coords})
        return self.topology.get_rank(**{**self._coord._asdict(), **coords, "pipe": stage_id})

    @property
    def prev_stage_rank(self) -> int | None:
        """Global rank of the previous stage (same other coordinates); None on the first."""
        return None if self.is_first_stage else self.stage_to_global(self.stage_id - 1)

    @property
    def next_stage_rank(self) -> int | None:
        """Global rank of the next stage (same other coordinates); None on the last."""
        return None if self.is_last_stage else self.stage_to_global(self.stage_id + 1)


@runtime_checkable
class MpuProtocol(Protocol):
    """What DeepSpeed-style code asks of a model-parallel unit (``mpu=``): Megatron's core six.

    Satisfied by :class:`Mpu` and by Megatron's ``parallel_state`` module.
    """

    def get_model_parallel_rank(self) -> int: ...
    def get_model_parallel_group(self) -> Any: ...
    def get_model_parallel_world_size(self) -> int: ...
    def get_data_parallel_rank(self) -> int: ...
    def get_data_parallel_group(self) -> Any: ...
    def get_data_parallel_world_size(self) -> int: ...


class Mpu:
    """DeepSpeed's mpu protocol over a :class:`ProcessGrid`.

    Model parallel is the ``'model'`` axis (see [Note: model parallel means the 'model' axis]);
    axes the topology lacks report rank 0 of 1 with a singleton group.
    """

    def __init__(self, grid: ProcessGrid) -> None:
        self.grid = grid

    def get_model_parallel_rank(self) -> int:
        return self.grid.axis_rank("model")

    def get_model_parallel_group(self) -> Any:
        return self.grid.get_group("model")

    def get_model_parallel_world_size(self) -> int:
        return self.grid.axis_world_size("model")

    def get_data_parallel_rank(self) -> int:
        return self.grid.axis_rank("data")

    def get_data_parallel_group(self) -> Any:
        return self.grid.get_group("data")

    def get_data_parallel_world_size(self) -> int:
        return self.grid.axis_world_size("data")

    def get_pipe_parallel_rank(self) -> int:
        return self.grid.axis_rank("pipe")

    def get_pipe_parallel_group(self) -> Any:
        return self.grid.get_group("pipe")

    def get_pipe_parallel_world_size(self) -> int:
        return self.grid.axis_world_size("pipe")

    # Megatron's newer names for the same thing.
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
