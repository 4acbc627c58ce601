"""Rank layouts (pure coordinate arithmetic, DeepSpeed's documented order) and, on real ranks,
the per-axis process groups of ProcessGrid and the Mpu view over them."""

from __future__ import annotations

import itertools

import pytest

from ds_comm._topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)
from ds_testing import run_on_ranks


def test_pipe_data_2x2() -> None:
    topo = PipeDataParallelTopology(num_pp=2, num_dp=2)
    assert topo.get_axis_names() == ["pipe", "data"]
    assert [topo.get_rank(pipe=p, data=d) for p in range(2) for d in range(2)] == [0, 1, 2, 3]
    assert topo.get_coord(2) == (1, 0) and topo.get_coord(2).pipe == 1
    assert topo.get_axis_comm_lists("data") == [[0, 1], [2, 3]]
    assert topo.get_axis_comm_lists("pipe") == [[0, 2], [1, 3]]
    assert topo.get_axis_comm_lists("model") == []
    assert topo.get_dim("data") == 2 and topo.get_dim("model") == 0
    assert topo.filter_match(pipe=1) == [2, 3]
    assert topo.get_axis_list("data", 1) == [1, 3]
    assert topo.world_size() == 4


def test_pipe_model_data_2x2x2_rank_order() -> None:
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert topo.get_axis_names() == ["pipe", "data", "model"]
    for p, d, m in itertools.product(range(2), repeat=3):
        rank = p * 4 + d * 2 + m
        assert topo.get_rank(pipe=p, data=d, model=m) == rank
        assert topo.get_coord(rank) == topo.ProcessCoord(pipe=p, data=d, model=m)
    assert topo.get_axis_comm_lists("model") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert topo.get_axis_comm_lists("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert topo.get_axis_comm_lists("pipe") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.filter_match(pipe=0, model=1) == [1, 3]
    assert topo.filter_match() == list(range(8))
    assert topo.get_axis_list("pipe", 1) == [4, 5, 6, 7]


def test_uneven_dims_keep_argument_order() -> None:
    # 2 x 3 x 4 catches a swapped (num_mp, num_dp) that a cube cannot.
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=3, num_dp=4)
    assert (topo.get_dim("pipe"), topo.get_dim("data"), topo.get_dim("model")) == (2, 4, 3)
    assert topo.world_size() == 24
    for p, d, m in itertools.product(range(2), range(4), range(3)):
        assert topo.get_rank(pipe=p, data=d, model=m) == p * 12 + d * 3 + m
    lists = topo.get_axis_comm_lists("data")
    assert len(lists) == 6 and lists[0] == [0, 3, 6, 9] and lists[1] == [1, 4, 7, 10]
    # Every axis partitions the world.
    for axis in topo.get_axis_names():
        assert sorted(r for group in topo.get_axis_comm_lists(axis) for r in group) == list(
            range(24)
        )


def test_generic_axes_with_expert() -> None:
    topo = ProcessTopology(axes=["pipe", "expert", "data"], dims=[1, 2, 3])
    assert topo.get_rank(pipe=0, expert=1, data=2) == 5
    assert topo.get_axis_comm_lists("expert") == [[0, 3], [1, 4], [2, 5]]
    assert topo.get_axis_comm_lists("data") == [[0, 1, 2], [3, 4, 5]]
    assert topo.get_rank_repr(4) == "expert_01"


def test_rank_repr() -> None:
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert topo.get_rank_repr(5) == "model_01"
    assert topo.get_rank_repr(5, omit_axes=[]) == "pipe_01-data_00-model_01"
    assert topo.get_rank_repr(6, omit_axes=["model"], inner_sep="=", outer_sep="/") == (
        "pipe=01/data=01"
    )
    assert PipeDataParallelTopology(num_pp=2, num_dp=2).get_rank_repr(3) == ""


def test_errors() -> None:
    topo = PipeDataParallelTopology(num_pp=2, num_dp=2)
    with pytest.raises(ValueError, match="filter_match"):
        topo.get_rank(pipe=0)
    with pytest.raises(ValueError, match="outside"):
        topo.get_rank(pipe=2, data=0)
    with pytest.raises(ValueError, match="rank 4 not found"):
        topo.get_coord(4)
    with pytest.raises(ValueError, match="dim"):
        ProcessTopology(axes=["a", "b"], dims=[2])
    with pytest.raises(ValueError, match=">= 1"):
        ProcessTopology(axes=["a"], dims=[0])
    with pytest.raises(ValueError, match="distinct"):
        ProcessTopology(axes=["a", "a"], dims=[1, 1])


_MPU_AXES = ("pipe", "data", "model")


def _grid_body(rank: int, world_size: int, *, axes: list[str], dims: list[int]) -> dict:
    import torch
    import torch.distributed as dist

    from ds_comm._topology import Mpu, MpuProtocol, ProcessGrid, ProcessTopology

    grid = ProcessGrid(ProcessTopology(axes=axes, dims=dims))
    mpu = Mpu(grid)
    assert isinstance(mpu, MpuProtocol)
    sums, group_ranks, group_sizes = {}, {}, {}
    for axis in (*axes, *(a for a in _MPU_AXES if a not in axes)):
        group = grid.get_group(axis)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        sums[axis] = t.item()
        group_ranks[axis] = dist.get_rank(group)
        group_sizes[axis] = dist.get_world_size(group)
    return {
        "coord": tuple(grid.get_coord()),
        "sums": sums,
        "group_ranks": group_ranks,
        "group_sizes": group_sizes,
        "axis": {a: (grid.axis_rank(a), grid.axis_world_size(a)) for a in _MPU_AXES},
        "members": {a: grid.get_ranks(a) for a in _MPU_AXES},
        "mpu": {
            "model": (mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()),
            "tensor": (
                mpu.get_tensor_model_parallel_rank(),
                mpu.get_tensor_model_parallel_world_size(),
            ),
            "data": (mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()),
            "pipe": (mpu.get_pipe_parallel_rank(), mpu.get_pipe_parallel_world_size()),
            "groups_match": (
                mpu.get_model_parallel_group() is grid.get_group("model")
                and mpu.get_tensor_model_parallel_group() is grid.get_group("model")
                and mpu.get_data_parallel_group() is grid.get_group("data")
                and mpu.get_pipe_parallel_group() is grid.get_group("pipe")
            ),
        },
        "stages": (
            grid.stage_id,
            grid.is_first_stage,
            grid.is_last_stage,
            grid.prev_stage_rank,
            grid.next_stage_rank,
        ),
    }


@pytest.mark.parametrize(
    ("world_size", "axes", "dims"),
    [
        (1, ["pipe", "data"], [1, 1]),
        (4, ["pipe", "data"], [2, 2]),
        (4, ["data", "model"], [2, 2]),
        (2, ["expert", "data"], [2, 1]),
    ],
    ids=["1", "pipe2xdata2", "data2xmodel2", "expert2"],
)
def test_process_grid_groups(world_size: int, axes: list[str], dims: list[int]) -> None:
    topo = ProcessTopology(axes=axes, dims=dims)
    results = run_on_ranks(_grid_body, world_size, axes=axes, dims=dims)
    for rank, res in enumerate(results):
        coord = topo.get_coord(rank)
        assert res["coord"] == tuple(coord)
        for axis in res["sums"]:
            # The group along `axis` is the comm list holding this rank (itself alone for an
            # axis the topology lacks): its all_reduce of global ranks proves the membership.
            (members,) = [g for g in topo.get_axis_comm_lists(axis) if rank in g] or [[rank]]
            assert res["sums"][axis] == float(sum(members)), (rank, axis)
            assert res["group_sizes"][axis] == len(members)
            assert res["group_ranks"][axis] == members.index(rank)
        for axis in _MPU_AXES:
            index = getattr(coord, axis) if axis in axes else 0
            size = max(topo.get_dim(axis), 1)
            assert res["axis"][axis] == (index, size)
            assert res["mpu"][axis] == (index, size)
            assert rank in res["members"][axis] and len(res["members"][axis]) == size
        assert res["mpu"]["tensor"] == res["mpu"]["model"]
        assert res["mpu"]["groups_match"]
        stage, stages = res["axis"]["pipe"]
        prev_rank = topo.get_rank(**{**coord._asdict(), "pipe": stage - 1}) if stage > 0 else None
        next_rank = (
            topo.get_rank(**{**coord._asdict(), "pipe": stage + 1}) if stage < stages - 1 else None
        )
        assert res["stages"] == (stage, stage == 0, stage == stages - 1, prev_rank, next_rank)


def test_pipe_neighbours_on_2x2() -> None:
    # Spelled out for the 2 x 2 pipe x data grid: stage 0 is ranks 0, 1; stage 1 is ranks 2, 3.
    results = run_on_ranks(_grid_body, 4, axes=["pipe", "data"], dims=[2, 2])
    assert [r["stages"] for r in results] == [
        (0, True, False, None, 2),
        (0, True, False, None, 3),
        (1, False, True, 0, None),
        (1, False, True, 1, None),
    ]


def _grid_size_mismatch(rank: int, world_size: int) -> str:
    from ds_comm._topology import PipeDataParallelTopology, ProcessGrid

    try:
        ProcessGrid(PipeDataParallelTopology(num_pp=2, num_dp=2))
    except ValueError as exc:
        return str(exc)
    raise AssertionError("a 4-rank topology was accepted on a 2-rank world")


def test_grid_rejects_wrong_world_size() -> None:
    messages = run_on_ranks(_grid_size_mismatch, 2)
    assert all("spans 4 ranks but the default group has 2" in m for m in messages)
