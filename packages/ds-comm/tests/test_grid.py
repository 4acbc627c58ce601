"""ParallelGrid: every axis's rank lists (hand-computed) and, on 4 real gloo ranks, every
group's membership proven by an all_reduce of the members' ranks."""

from __future__ import annotations

from typing import Any

import pytest

from ds_comm._grid import GRID_AXES, ParallelLayout
from ds_testing import run_on_ranks

S = [[0], [1], [2], [3]]  # singleton groups of a size-1 axis on 4 ranks
# (sizes, {axis: every group of that axis}) for the 4-rank grids.
CASES: list[tuple[dict[str, Any], dict[str, list[list[int]]]]] = [
    (
        {"pp": 2, "dp": 2},
        {
            "pp": [[0, 2], [1, 3]],
            "dp": [[0, 1], [2, 3]],
            "sp": S,
            "tp": S,
            "ep": S,
            "edp": [[0, 1], [2, 3]],
            "sequence_data_parallel": [[0, 1], [2, 3]],
            "replica": [[0, 2], [1, 3]],  # every axis but dp
        },
    ),
    (
        {"dp": 2, "tp": 2},
        {
            "pp": S,
            "dp": [[0, 2], [1, 3]],
            "sp": S,
            "tp": [[0, 1], [2, 3]],
            "ep": [[0], [2], [1], [3]],  # in dp-group order, as DeepSpeed creates them
            "edp": [[0, 2], [1, 3]],
            "sequence_data_parallel": [[0, 2], [1, 3]],
            "replica": [[0, 1], [2, 3]],  # every axis but dp
        },
    ),
    (
        {"dp": 2, "sp": 2},
        {
            "pp": S,
            "dp": [[0, 2], [1, 3]],
            "sp": [[0, 1], [2, 3]],
            "tp": S,
            "ep": [[0], [2], [1], [3]],
            "edp": [[0, 2], [1, 3]],
            "sequence_data_parallel": [[0, 1, 2, 3]],
            "replica": [[0, 1], [2, 3]],  # every axis but dp
        },
    ),
    (
        {"dp": 4, "ep": 2},
        {
            "pp": S,
            "dp": [[0, 1, 2, 3]],
            "sp": S,
            "tp": S,
            "ep": [[0, 1], [2, 3]],
            "edp": [[0, 2], [1, 3]],
            "sequence_data_parallel": [[0, 1, 2, 3]],
            "replica": S,  # every axis but dp
        },
    ),
]


@pytest.mark.parametrize(("sizes", "expected"), CASES, ids=["pp2dp2", "dp2tp2", "dp2sp2", "dp4ep2"])
def test_layout_rank_lists(sizes: dict[str, Any], expected: dict[str, list[list[int]]]) -> None:
    layout = ParallelLayout(4, **sizes)
    assert {a: layout.rank_lists(a) for a in GRID_AXES} == expected
    assert layout.rank_lists("model_parallel") == expected["tp"]
    assert layout.rank_lists("data_parallel") == expected["dp"]


def test_layout_order_and_deepspeed_expert_example() -> None:
    # Megatron order: rank = pp * (dp*sp*tp) + dp * (sp*tp) + sp * tp + tp.
    layout = ParallelLayout(16, pp=2, dp=2, sp=2, tp=2)
    assert layout.coord(13) == {"pp": 1, "dp": 1, "sp": 0, "tp": 1}
    assert layout.ranks_of("dp", 13) == [9, 13]
    assert layout.ranks_of("sequence_data_parallel", 13) == [9, 11, 13, 15]
    # A chosen order: tp outermost.
    assert ParallelLayout(4, dp=2, tp=2, order=["tp", "pp", "dp", "sp"]).rank_lists("tp") == [
        [0, 2],
        [1, 3],
    ]
    # DeepSpeed's documented example: 16 ranks, tp 2, ep 4.
    moe = ParallelLayout(16, tp=2, ep=4)
    assert moe.rank_lists("ep")[:3] == [[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7]]
    assert moe.rank_lists("edp")[:2] == [[0, 8], [2, 10]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"pp": 2, "dp": 4}, "pp=2 x dp=4 x sp=1 x tp=1 = 8 but the world has 4 ranks"),
        ({"tp": 3}, "pp=1 x sp=1 x tp=3 = 3 does not divide the world size 4"),
        ({"dp": 4, "ep": 3}, "ep=3 must divide dp=4"),
        ({"tp": 0, "dp": 4}, "every parallel size must be >= 1, got {'tp': 0}"),
        ({"order": ["pp", "dp", "tp"]}, "order must be a permutation of"),
    ],
)
def test_layout_rejects_wrong_sizes(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("{", r"\{")):
        ParallelLayout(4, **kwargs)


def _grid_body(rank: int, world_size: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    from ds_comm._grid import GRID_AXES, ParallelGrid

    out = []
    for sizes, _ in CASES:
        grid = ParallelGrid(**sizes)
        mpu = grid.mpu()
        sums = {}
        for axis in GRID_AXES:
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=grid.get_group(axis))
            sums[axis] = t.item()
        out.append(
            {
                "sums": sums,
                "ranks": {a: grid.ranks_of(a) for a in GRID_AXES},
                "pos": {a: (grid.axis_rank(a), grid.axis_world_size(a)) for a in GRID_AXES},
                "mpu": {
                    "mp": (mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()),
                    "tp": (
                        mpu.get_tensor_model_parallel_rank(),
                        mpu.get_tensor_model_parallel_world_size(),
                    ),
                    "dp": (mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()),
                    "pp": (
                        mpu.get_pipeline_model_parallel_rank(),
                        mpu.get_pipeline_model_parallel_world_size(),
                    ),
                    "sp": (
                        mpu.get_sequence_parallel_rank(),
                        mpu.get_sequence_parallel_world_size(),
                    ),
                    "ep": (
                        mpu.get_expert_model_parallel_rank(),
                        mpu.get_expert_model_parallel_world_size(),
                    ),
                    "edp": (
                        mpu.get_expert_data_parallel_rank(),
                        mpu.get_expert_data_parallel_world_size(),
                    ),
                    "same_groups": mpu.get_model_parallel_group() is grid.get_group("tp")
                    and mpu.get_data_parallel_group() is grid.get_group("data_parallel")
                    and mpu.get_sequence_data_parallel_group()
                    is grid.get_group("sequence_data_parallel"),
                },
            }
        )
    try:
        ParallelGrid(pp=2, dp=4)
    except ValueError as exc:
        out.append({"error": str(exc)})
    return out


def test_grid_groups_on_four_ranks() -> None:
    results = run_on_ranks(_grid_body, 4)
    mpu_axes = {"mp": "tp", "tp": "tp", "dp": "dp", "pp": "pp", "sp": "sp", "ep": "ep"}
    for rank, per_case in enumerate(results):
        assert "8 but the world has 4 ranks" in per_case[-1]["error"]
        for (_, expected), res in zip(CASES, per_case[:-1]):
            for axis in GRID_AXES:
                (members,) = [g for g in expected[axis] if rank in g]
                assert res["ranks"][axis] == members, (rank, axis)
                assert res["sums"][axis] == float(sum(members)), (rank, axis)
                assert res["pos"][axis] == (members.index(rank), len(members))
            for name, axis in {**mpu_axes, "edp": "edp"}.items():
                assert res["mpu"][name] == res["pos"][axis], (rank, name)
            assert res["mpu"]["same_groups"]


def test_layout_rank_arithmetic_is_the_topologys() -> None:
    from ds_comm import PipeModelDataParallelTopology, ProcessTopology
    from ds_comm._grid import ParallelGrid

    layout = ParallelLayout(8, pp=2, dp=2, tp=2)
    deepspeed = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    assert isinstance(layout.topology, ProcessTopology)
    for rank in range(8):
        coord = deepspeed.get_coord(rank)
        assert layout.coord(rank) == {
            "pp": coord.pipe,
            "dp": coord.data,
            "sp": 0,
            "tp": coord.model,
        }
        assert layout.ranks_of("tp", rank) == next(
            g for g in deepspeed.get_axis_comm_lists("model") if rank in g
        )
    with pytest.raises(ValueError, match=r"axes \['expert'\] have no ParallelGrid axis"):
        ParallelGrid.from_topology(ProcessTopology(["pipe", "expert"], [1, 2]))
