"""ExpertParallelGroups(grid=...): ds-comm's ParallelGrid supplies the expert groups (the grid's
own for its ep, new ones laid out the same way for other ep sizes), matching the mpu path."""

from __future__ import annotations

import pytest

from ds_testing import run_on_ranks


def _grid_groups_body(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist

    import ds_moe
    from ds_comm import ConfigError, ParallelGrid

    out: dict = {}
    grid = ParallelGrid(dp=4, ep=2)
    groups = ds_moe.ExpertParallelGroups(grid=grid)
    g2, g4, g1 = groups.add(2), groups.add(4), groups.add(1)
    out["reused"] = g2.expert_parallel_group is grid.get_group(
        "ep"
    ) and g2.expert_data_parallel_group is grid.get_group("edp")
    out["ranks"] = {
        n: (g.expert_parallel_ranks, g.expert_data_parallel_ranks)
        for n, g in (("2", g2), ("4", g4), ("1", g1))
    }
    out["none_for_one"] = (g4.expert_data_parallel_group, g1.expert_parallel_group) == (None, None)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=g4.expert_parallel_group)
    out["sum4"] = t.item()
    out["dense"] = groups.data_parallel_group is grid.get_group("dp")
    # dp2 x tp2: the grid path equals the mpu path over the same grid.
    tp_grid = ParallelGrid(dp=2, tp=2)
    by_grid = ds_moe.ExpertParallelGroups(grid=tp_grid).add(2)
    by_mpu = ds_moe.ExpertParallelGroups(mpu=tp_grid.mpu()).add(2)
    out["tp_same"] = (by_grid.expert_parallel_ranks, by_grid.expert_data_parallel_ranks) == (
        by_mpu.expert_parallel_ranks,
        by_mpu.expert_data_parallel_ranks,
    )
    try:
        ds_moe.ExpertParallelGroups(grid=grid).add(3)
    except ConfigError as exc:
        out["error"] = str(exc)
    return out


def test_expert_groups_from_the_grid() -> None:
    results = run_on_ranks(_grid_groups_body, 4)
    for rank, res in enumerate(results):
        assert res["reused"] and res["dense"] and res["none_for_one"] and res["tp_same"]
        pair = [0, 1] if rank < 2 else [2, 3]
        assert res["ranks"]["2"] == (tuple(pair), (rank % 2, rank % 2 + 2))
        assert res["ranks"]["4"] == ((0, 1, 2, 3), (rank,))
        assert res["ranks"]["1"] == ((rank,), (0, 1, 2, 3))
        assert res["sum4"] == 6.0
        assert "MoE ep_size = 3: ep=3 must divide dp=4" in res["error"]


def test_grid_excludes_mpu_and_data_before_expert() -> None:
    import ds_moe
    from ds_comm import ConfigError

    with pytest.raises(ConfigError, match="pass neither mpu= nor"):
        ds_moe.ExpertParallelGroups(grid=object(), use_data_before_expert_parallel_=True)  # type: ignore[arg-type]
