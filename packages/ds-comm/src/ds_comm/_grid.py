"""One grid for every parallelism: named pp/dp/sp/tp axes (ep inside dp), their rank lists
(:class:`ParallelLayout`, pure arithmetic) and their process groups (:class:`ParallelGrid`).

[Note: parallel grid layout]
Ranks enumerate the cartesian product of ``order`` (default ``('pp', 'dp', 'sp', 'tp')``), the
first axis slowest, as DeepSpeed and Megatron do: tensor-parallel peers are adjacent (fastest
links) and pipeline stages farthest apart. Expert parallelism is a sub-axis of data parallelism,
as in DeepSpeed's ``groups._create_expert_and_data_parallel``: each data-parallel group (in rank
order) is cut into runs of ``ep`` consecutive members (the expert-parallel groups, ``'ep'``), and
the members at the same position of each run form the expert-data-parallel group (``'edp'``).
Combined groups: ``'model_parallel'`` is ``'tp'`` (Megatron's mpu meaning, see [Note: model
parallel means the 'model' axis]), ``'data_parallel'`` is ``'dp'`` and
``'sequence_data_parallel'`` spans ``sp x dp`` (what ZeRO reduces over under Ulysses) and
``'replica'`` spans every axis but ``dp`` (``pp x sp x tp``: the ranks holding one model replica,
DeepSpeed's ``PipelineParallelGrid`` model-parallel group).

[Note: one rank arithmetic]
The rank <-> coordinate map is :class:`~ds_comm.ProcessTopology`'s, and only its: a layout is a
``ProcessTopology`` over ``order`` (:attr:`ParallelLayout.topology`). DeepSpeed's pipeline
topologies name the same axes ``pipe``/``data``/``model`` (:data:`DEEPSPEED_AXES`);
:meth:`ParallelGrid.from_topology` builds the grid of such a topology, which is how ds-comm's
``ProcessGrid`` (and through it ds-pipe's ``PipelineModule`` and DeepSpeed's
``PipelineParallelGrid``) get their groups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from ds_comm._topology import ProcessTopology

__all__ = ["DEEPSPEED_AXES", "GRID_AXES", "GridMpu", "ParallelGrid", "ParallelLayout"]

#: Every name :meth:`ParallelLayout.ranks_of` accepts.
GRID_AXES = ("pp", "dp", "sp", "tp", "ep", "edp", "sequence_data_parallel", "replica")
_ORDERED = ("pp", "dp", "sp", "tp")
_ALIASES = {"model_parallel": "tp", "data_parallel": "dp"}
#: DeepSpeed's topology axis names (``PipeModelDataParallelTopology``) -> the grid's.
DEEPSPEED_AXES = {"pipe": "pp", "data": "dp", "model": "tp"}


class ParallelLayout:
    """The rank lists of every axis of a ``pp x dp x sp x tp`` grid (ep inside dp), no groups.

    Args:
        world_size: number of ranks; must equal ``pp * dp * sp * tp``.
        pp, dp, sp, tp: axis sizes; ``dp=None`` takes what the others leave of the world.
        ep: expert-parallel size, a divisor of ``dp``.
        order: the four ordered axes, slowest first; see [Note: parallel grid layout].

    Example:
        >>> layout = ParallelLayout(4, pp=2, dp=2)
        >>> layout.ranks_of("dp", 2), layout.ranks_of("pp", 2)
        ([2, 3], [0, 2])
    """

    def __init__(
        self,
        world_size: int,
        *,
        pp: int = 1,
        dp: int | None = None,
        sp: int = 1,
        tp: int = 1,
        ep: int = 1,
        order: Sequence[str] = _ORDERED,
    ) -> None:
        if sorted(order) != sorted(_ORDERED):
            raise ValueError(f"order must be a permutation of {list(_ORDERED)}, got {list(order)}")
        others = pp * sp * tp
        if dp is None:
            if others < 1 or world_size % others:
                raise ValueError(
                    f"pp={pp} x sp={sp} x tp={tp} = {others} does not divide the world size "
                    f"{world_size}; choose sizes whose product divides {world_size}"
                )
            dp = world_size // others
        self.sizes = {"pp": pp, "dp": dp, "sp": sp, "tp": tp}
        bad = {k: v for k, v in {**self.sizes, "ep": ep}.items() if int(v) < 1}
        if bad:
            raise ValueError(f"every parallel size must be >= 1, got {bad}")
        product = pp * dp * sp * tp
        if product != world_size:
            raise ValueError(
                f"pp={pp} x dp={dp} x sp={sp} x tp={tp} = {product} but the world has "
                f"{world_size} ranks; choose sizes whose product is {world_size}"
            )
        if dp % ep:
            raise ValueError(
                f"ep={ep} must divide dp={dp} (expert parallelism is a sub-axis of data "
                f"parallelism); choose an ep among the divisors of {dp}"
            )
        self.world_size = world_size
        self.ep = ep
        self.order = tuple(order)
        #: The rank <-> coordinate map (see [Note: one rank arithmetic]).
        self.topology = ProcessTopology(self.order, [self.sizes[a] for a in self.order])
        self._coords = [self.topology.get_coord(r)._asdict() for r in range(world_size)]
        self._lists: dict[str, list[list[int]]] = {a: self._span([a]) for a in _ORDERED}
        self._lists["sequence_data_parallel"] = self._span(["sp", "dp"])
        self._lists["replica"] = self._span(["pp", "sp", "tp"])
        runs = [dp_ranks[i : i + ep] for dp_ranks in self._lists["dp"] for i in range(0, dp, ep)]
        self._lists["ep"] = runs
        self._lists["edp"] = [dp_ranks[j::ep] for dp_ranks in self._lists["dp"] for j in range(ep)]

    def _span(self, axes: Sequence[str]) -> list[list[int]]:
        """Rank lists whose members differ only on ``axes``, in order of their lowest rank."""
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank, coord in enumerate(self._coords):
            key = tuple(v for a, v in coord.items() if a not in axes)
            groups.setdefault(key, []).append(rank)
        return list(groups.values())

    @staticmethod
    def canonical(axis: str) -> str:
        """``axis`` with the combined names (``model_parallel``/``data_parallel``) resolved."""
        name = _ALIASES.get(axis, axis)
        if name not in GRID_AXES:
            raise KeyError(f"unknown grid axis {axis!r}; choose from {[*GRID_AXES, *_ALIASES]}")
        return name

    def rank_lists(self, axis: str) -> list[list[int]]:
        """Every group of ``axis``, in creation order (lowest member first)."""
        return [list(r) for r in self._lists[self.canonical(axis)]]

    def ranks_of(self, axis: str, rank: int) -> list[int]:
        """The members of ``rank``'s group along ``axis``, in axis order."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        (members,) = [r for r in self._lists[self.canonical(axis)] if rank in r]
        return list(members)

    def coord(self, rank: int) -> dict[str, int]:
        """``rank``'s coordinate on each ordered axis."""
        return dict(self._coords[rank])


GroupFactory = Callable[..., Any]


class ParallelGrid:
    """This rank's process group on every axis of a :class:`ParallelLayout`.

    Constructing it is collective: every rank must construct it with the same sizes, because
    every group of every axis is created on every rank in the same order (torch's rule for
    ``new_group``). A rank list met twice (e.g. ``edp`` equals ``dp`` when ``ep=1``) reuses
    the group already made.

    Args:
        pp, dp, sp, tp, ep, order: as :class:`ParallelLayout`; the world is the default group.
        group_factory: creates one group from ``ranks=``; ``torch.distributed.new_group``.

    Example:
        >>> grid = ParallelGrid(tp=2)  # dp = world / 2
        >>> dist.all_reduce(grads, group=grid.get_group("dp"))
    """

    def __init__(
        self,
        *,
        pp: int = 1,
        dp: int | None = None,
        sp: int = 1,
        tp: int = 1,
        ep: int = 1,
        order: Sequence[str] = _ORDERED,
        group_factory: GroupFactory = dist.new_group,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "ParallelGrid needs the default process group: call "
                "ds_comm.init_distributed() (deepspeed.init_distributed()) first"
            )
        self.layout = ParallelLayout(
            dist.get_world_size(), pp=pp, dp=dp, sp=sp, tp=tp, ep=ep, order=order
        )
        self.rank = dist.get_rank()
        made: dict[tuple[int, ...], Any] = {}
        self._groups: dict[str, Any] = {}
        for axis in GRID_AXES:
            for ranks in self.layout.rank_lists(axis):
                key = tuple(ranks)
                if key not in made:
                    made[key] = group_factory(ranks=ranks)
                if self.rank in ranks:
                    self._groups[axis] = made[key]

    def get_group(self, axis: str) -> Any:
        """The process group of this rank's peers along ``axis`` (or a combined name)."""
        return self._groups[self.layout.canonical(axis)]

    def ranks_of(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along ``axis``, in axis order."""
        return self.layout.ranks_of(axis, self.rank)

    def axis_rank(self, axis: str) -> int:
        """This rank's position in its ``axis`` group."""
        return self.ranks_of(axis).index(self.rank)

    def axis_world_size(self, axis: str) -> int:
        """The size of this rank's ``axis`` group."""
        return len(self.ranks_of(axis))

    def mpu(self) -> GridMpu:
        """DeepSpeed's / Megatron's mpu interface over this grid (``mpu=`` of initialize)."""
        return GridMpu(self)

    @staticmethod
    def of(unit: Any) -> ParallelGrid | None:
        """The ParallelGrid behind an mpu-like ``unit``: the grid itself, a ``GridMpu``'s, the
        ``parallel_grid`` of a ``ProcessGrid``, of an ``Mpu`` over one or of DeepSpeed's
        ``PipelineParallelGrid``; None for a unit without one (Megatron's ``parallel_state``)."""
        if isinstance(unit, ParallelGrid):
            return unit
        for holder in (unit, getattr(unit, "grid", None)):
            for attr in ("grid", "parallel_grid"):
                found = getattr(holder, attr, None)
                if isinstance(found, ParallelGrid):
                    return found
        return None

    @classmethod
    def from_topology(
        cls, topology: ProcessTopology, *, group_factory: GroupFactory = dist.new_group
    ) -> ParallelGrid:
        """The grid of a DeepSpeed topology whose axes are among ``pipe``/``data``/``model``
        (``PipeDataParallelTopology``, ``PipeModelDataParallelTopology``): same sizes, same
        rank order (collective, like the constructor).

        Raises:
            ValueError: an axis outside :data:`DEEPSPEED_AXES`.
        """
        unknown = [a for a in topology.get_axis_names() if a not in DEEPSPEED_AXES]
        if unknown:
            raise ValueError(
                f"{topology!r}: axes {unknown} have no ParallelGrid axis; a grid topology names "
                f"its axes among {sorted(DEEPSPEED_AXES)} (pipe -> pp, data -> dp, model -> tp)"
            )
        named = [DEEPSPEED_AXES[a] for a in topology.get_axis_names()]
        sizes = {axis: topology.get_dim(name) for name, axis in zip(topology.axes, named)}
        order = [*named, *(a for a in _ORDERED if a not in named)]
        return cls(**sizes, order=order, group_factory=group_factory)


def _accessors(axis: str) -> tuple[Any, Any, Any]:
    def group(self: GridMpu) -> Any:
        return self.grid.get_group(axis)

    def rank(self: GridMpu) -> int:
        return self.grid.axis_rank(axis)

    def world_size(self: GridMpu) -> int:
        return self.grid.axis_world_size(axis)

    for fn, what in ((group, "group"), (rank, "rank"), (world_size, "world size")):
        fn.__doc__ = f"This rank's {what} along the grid's {axis!r} axis."
    return group, rank, world_size


class GridMpu:
    """DeepSpeed's mpu protocol (Megatron's ``parallel_state`` names) over a
    :class:`ParallelGrid`.

    Model parallel means tensor parallel (``'tp'``); pipeline names exist in Megatron's
    (``pipeline_model_parallel``) and DeepSpeed's grid's (``pipe_parallel``) spellings.
    """

    def __init__(self, grid: ParallelGrid) -> None:
        self.grid = grid

    get_model_parallel_group, get_model_parallel_rank, get_model_parallel_world_size = _accessors(
        "tp"
    )
    (
        get_tensor_model_parallel_group,
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    ) = _accessors("tp")
    get_data_parallel_group, get_data_parallel_rank, get_data_parallel_world_size = _accessors("dp")
    (
        get_pipeline_model_parallel_group,
        get_pipeline_model_parallel_rank,
        get_pipeline_model_parallel_world_size,
    ) = _accessors("pp")
    get_pipe_parallel_group, get_pipe_parallel_rank, get_pipe_parallel_world_size = _accessors("pp")
    (
        get_sequence_parallel_group,
        get_sequence_parallel_rank,
        get_sequence_parallel_world_size,
    ) = _accessors("sp")
    (
        get_sequence_data_parallel_group,
        get_sequence_data_parallel_rank,
        get_sequence_data_parallel_world_size,
    ) = _accessors("sequence_data_parallel")
    (
        get_expert_model_parallel_group,
        get_expert_model_parallel_rank,
        get_expert_model_parallel_world_size,
    ) = _accessors("ep")
    (
        get_expert_data_parallel_group,
        get_expert_data_parallel_rank,
        get_expert_data_parallel_world_size,
    ) = _accessors("edp")
