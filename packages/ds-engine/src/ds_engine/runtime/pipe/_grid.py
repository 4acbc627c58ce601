"""DeepSpeed's ``PipelineParallelGrid``: a rank's pipeline, data and model-parallel groups.

[Note: DeepSpeed's grid over ds-comm's]
Every group comes from the job's one ``ds_comm.ParallelGrid`` (:attr:`PipelineParallelGrid.
parallel_grid`, built from the topology: pipe -> pp, data -> dp, model -> tp, through
``ds_comm.ProcessGrid``); this class only names them as DeepSpeed does:

- its *model-parallel* group is every rank holding one model replica (the ranks sharing this
  rank's ``data`` coordinate: pipe x model, the grid's ``replica`` axis), which DeepSpeed's
  engine uses to agree on overflow and norms; Megatron's tensor slicing is the *slice* group
  (the ``model`` axis, the grid's ``tp``);
- ``p2p_groups``: for every rank, ``[rank, next stage's rank]``, wrapping around;
- no topology: the world size's prime factors dealt alternately to pipe and data, as DeepSpeed
  does (4 ranks: 2 stages x 2 replicas; 2 ranks: 2 stages).

Constructing it is collective, like DeepSpeed's: every rank creates the same groups in the same
order.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ds_comm import ParallelGrid, PipeDataParallelTopology, ProcessGrid, ProcessTopology

__all__ = ["PipelineParallelGrid"]


def _prime_factors(n: int) -> list[int]:
    factors, p = [], 2
    while n > 1:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors


def _default_topology(world_size: int) -> ProcessTopology:
    """DeepSpeed's default layout: prime factors alternately to pipe (first) and data."""
    num_pp = num_dp = 1
    for index, prime in enumerate(_prime_factors(world_size)):
        if index % 2 == 0:
            num_pp *= prime
        else:
            num_dp *= prime
    return PipeDataParallelTopology(num_pp=num_pp, num_dp=num_dp)


class PipelineParallelGrid:
    """This rank's stage, replica and process groups in a pipeline-parallel job (DeepSpeed's
    ``deepspeed.runtime.pipe.topology.PipelineParallelGrid``; also an ``mpu``).

    Args:
        topology: the rank layout, with ``pipe`` and ``data`` axes (and optionally ``model``);
            None: DeepSpeed's default split of the world size (see the module note).
        process_group: only None (the default group) is accepted; DeepSpeed ignores any other
            value, ds refuses it rather than ignore it.

    Raises:
        ValueError: a topology whose size is not the world size, or without a ``pipe`` or
            ``data`` axis.
        NotImplementedError: a ``process_group`` other than None, or an axis other than
            ``pipe``/``data``/``model``.

    Example:
        >>> grid = PipelineParallelGrid(PipeDataParallelTopology(num_pp=2, num_dp=2))
        >>> grid.get_stage_id(), grid.get_data_parallel_group_ranks()
    """

    def __init__(self, topology: ProcessTopology | None = None, process_group: Any = None):
        if process_group is not None:
            raise NotImplementedError(
                "PipelineParallelGrid(process_group=...) is not implemented in ds (DeepSpeed "
                "ignores it too): the grid spans the default group; pass process_group=None"
            )
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        topo = topology if topology is not None else _default_topology(self.world_size)
        missing = [axis for axis in ("pipe", "data") if axis not in topo.get_axis_names()]
        if missing:
            raise ValueError(
                f"PipelineParallelGrid needs 'pipe' and 'data' axes; {topo!r} lacks {missing}"
            )
        unknown = [a for a in topo.get_axis_names() if a not in ("pipe", "data", "model")]
        if unknown:
            raise NotImplementedError(
                f"PipelineParallelGrid: axes {unknown} of {topo!r} are not implemented in ds; "
                "a pipeline topology has 'pipe', 'data' and optionally 'model' axes"
            )
        self._topo = topo
        self._grid = ProcessGrid(topo)  # from the ParallelGrid (checks the world size)
        #: The ds-comm ParallelGrid every group here comes from.
        self.parallel_grid: ParallelGrid = self._grid.parallel_grid
        self.data_parallel_size = max(topo.get_dim("data"), 1)
        self.pipe_parallel_size = max(topo.get_dim("pipe"), 1)
        self.model_parallel_size = max(topo.get_dim("model"), 1)
        self.slice_parallel_size = self.model_parallel_size
        coord = topo.get_coord(self.global_rank)
        self.stage_id: int = coord.pipe
        self.data_parallel_id: int = coord.data
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        self._build_replica_groups()
        self.dp_groups = topo.get_axis_comm_lists("data")
        self.dp_group: list[int] = self._grid.get_ranks("data")
        self.dp_proc_group = self._grid.get_group("data")
        self.pipe_groups = topo.get_axis_comm_lists("pipe")
        self.pp_group: list[int] = self._grid.get_ranks("pipe")
        self.pp_proc_group = self._grid.get_group("pipe")
        self.slice_group: list[int] = self._grid.get_ranks("model")
        self.slice_proc_group = self._grid.get_group("model")
        if self.model_parallel_size > 1:
            self.model_groups = topo.get_axis_comm_lists("model")
        self.p2p_groups = self._build_p2p_groups()

    def _build_replica_groups(self) -> None:
        """This rank's model replica (every rank sharing its data coordinate): the grid's."""
        ranks = self.parallel_grid.ranks_of("replica")
        self.ds_model_proc_group = self.parallel_grid.get_group("replica")
        self.ds_model_world_size = len(ranks)
        self.ds_model_rank = ranks.index(self.global_rank)

    def _build_p2p_groups(self) -> list[list[int]]:
        """``[rank, rank of the next stage]`` for every rank, the last stage wrapping to 0."""
        pairs = []
        for rank in range(self.world_size):
            pipeline = next(ranks for ranks in self.pipe_groups if rank in ranks)
            nxt = pipeline[(pipeline.index(rank) + 1) % self.pipe_parallel_size]
            pairs.append([rank, nxt])
        return pairs

    def get_stage_id(self) -> int:
        """This rank's pipeline stage."""
        return self.stage_id

    def get_data_parallel_id(self) -> int:
        """Which pipeline (replica) this rank belongs to."""
        return self.data_parallel_id

    def stage_to_global(self, stage_id: int, **kwargs: int) -> int:
        """Global rank of ``stage_id`` with this rank's other coordinates (or ``kwargs``)."""
        return self._grid.stage_to_global(stage_id, **kwargs)

    def topology(self) -> ProcessTopology:
        """The rank layout."""
        return self._topo

    def get_global_rank(self) -> int:
        return self.global_rank

    def get_pipe_parallel_rank(self) -> int:
        """The stage of the pipeline this rank resides in."""
        return self.stage_id

    def get_pipe_parallel_world_size(self) -> int:
        """The number of stages."""
        return self.pipe_parallel_size

    def get_pipe_parallel_group(self) -> Any:
        """The ranks of this rank's pipeline."""
        return self.pp_proc_group

    def get_data_parallel_rank(self) -> int:
        """Which pipeline this rank resides in."""
        return self.data_parallel_id

    def get_data_parallel_world_size(self) -> int:
        """The number of pipelines."""
        return self.data_parallel_size

    def get_data_parallel_group(self) -> Any:
        """The ranks at this rank's stage (and slice) in every pipeline."""
        return self.dp_proc_group

    def get_data_parallel_group_ranks(self) -> list[int]:
        return self.dp_group

    def get_model_parallel_rank(self) -> int:
        """Rank within this rank's model replica (DeepSpeed's meaning: pipe x model)."""
        return self.ds_model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.ds_model_world_size

    def get_model_parallel_group(self) -> Any:
        return self.ds_model_proc_group

    def get_slice_parallel_rank(self) -> int:
        """Rank within the tensor-slicing (``model`` axis) group."""
        return self._grid.axis_rank("model")

    def get_slice_parallel_world_size(self) -> int:
        return self.slice_parallel_size

    def get_slice_parallel_group(self) -> Any:
        return self.slice_proc_group

    # Megatron's names for the same things, as DeepSpeed's grid has them.
    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_tensor_model_parallel_rank = get_slice_parallel_rank
    get_tensor_model_parallel_world_size = get_slice_parallel_world_size
