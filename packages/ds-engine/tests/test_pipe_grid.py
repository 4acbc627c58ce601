"""DeepSpeed's ``PipelineParallelGrid`` (``deepspeed.runtime.pipe.topology``) on 2 gloo ranks:
DeepSpeed's default layout, its attributes and accessors for pipe/data/model layouts, and groups
that really reduce over the ranks they name."""

from __future__ import annotations

from typing import Any

import pytest

from ds_testing import run_on_ranks


def _sum(value: int, group: Any) -> int:
    import torch

    import ds_comm

    tensor = torch.tensor([float(value)])
    ds_comm.all_reduce(tensor, group=group)
    return int(tensor.item())


def _grid_body(rank: int, world_size: int) -> dict[str, Any]:
    from ds_engine.runtime.pipe.topology import (
        PipeDataParallelTopology,
        PipelineParallelGrid,
        PipeModelDataParallelTopology,
    )

    layouts = {
        "default": None,  # DeepSpeed: 2 = one prime, to pipe: 2 stages x 1 replica
        "data": PipeDataParallelTopology(num_pp=1, num_dp=2),
        "model": PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=1),
    }
    seen: dict[str, Any] = {}
    for name, topology in layouts.items():
        grid = PipelineParallelGrid(topology)
        seen[name] = {
            "sizes": (grid.pipe_parallel_size, grid.data_parallel_size, grid.model_parallel_size),
            "stage": (grid.get_stage_id(), grid.is_first_stage, grid.is_last_stage),
            "data": (grid.get_data_parallel_rank(), grid.get_data_parallel_group_ranks()),
            "pipe": (grid.get_pipe_parallel_rank(), grid.pp_group),
            "replica": (grid.get_model_parallel_rank(), grid.get_model_parallel_world_size()),
            "slice": (grid.get_tensor_model_parallel_rank(), grid.slice_group),
            "p2p": grid.p2p_groups,
            "next": grid.stage_to_global(grid.pipe_parallel_size - 1),
            # each group sums the global ranks it holds: proof it spans exactly those ranks
            "sums": (
                _sum(rank, grid.get_data_parallel_group()),
                _sum(rank, grid.get_pipe_parallel_group()),
                _sum(rank, grid.get_model_parallel_group()),
                _sum(rank, grid.get_slice_parallel_group()),
            ),
        }
    try:
        PipelineParallelGrid(process_group=object())
    except NotImplementedError as error:
        seen["refused"] = str(error)
    return seen


def test_grid_matches_deepspeeds_layouts_and_groups() -> None:
    results = run_on_ranks(_grid_body, 2)
    for rank, seen in enumerate(results):
        other = 1 - rank
        default = seen["default"]
        assert default["sizes"] == (2, 1, 1)
        assert default["stage"] == (rank, rank == 0, rank == 1)
        assert default["data"] == (0, [rank])
        assert default["pipe"] == (rank, [0, 1])
        assert default["replica"] == (rank, 2)  # the replica spans both stages
        assert default["slice"] == (0, [rank])
        assert default["p2p"] == [[0, 1], [1, 0]]
        assert default["next"] == 1
        assert default["sums"] == (rank, 1, 1, rank)

        data = seen["data"]
        assert data["sizes"] == (1, 2, 1)
        assert data["stage"] == (0, True, True)
        assert data["data"] == (rank, [0, 1])
        assert data["replica"] == (0, 1)
        assert data["p2p"] == [[0, 0], [1, 1]]
        assert data["sums"] == (1, rank, rank, rank)

        model = seen["model"]
        assert model["sizes"] == (1, 1, 2)
        assert model["slice"] == (rank, [0, 1])
        assert model["replica"] == (rank, 2)  # pipe x model: both slices hold one replica
        assert model["sums"] == (rank, rank, 1, 1)
        assert other in model["slice"][1]

        assert "not implemented in ds" in seen["refused"]


@pytest.mark.parametrize(("world_size", "dims"), [(1, (1, 1)), (4, (2, 2)), (12, (6, 2))])
def test_default_layout_deals_prime_factors_like_deepspeed(
    world_size: int, dims: tuple[int, int]
) -> None:
    from ds_engine.runtime.pipe._grid import _default_topology

    topology = _default_topology(world_size)
    assert (topology.get_dim("pipe"), topology.get_dim("data")) == dims
