"""Expert-parallel and expert-data-parallel groups: DeepSpeed's documented layouts (pure), the
groups built on real ranks, and gradient reduction over the right group for each parameter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ds_moe
from ds_comm import ConfigError
from ds_testing import run_on_ranks


def _lists(topo, axis: str) -> list[list[int]]:
    return sorted(topo.get_axis_comm_lists(axis))


def test_expert_then_data_layout_is_deepspeeds_default() -> None:
    # DeepSpeed's docstring: world 16, ep 2 -> ep groups [0,1], [2,3], ...; edp [0,2,...,14], ...
    topo = ds_moe.expert_topology(16, 2)
    assert _lists(topo, "expert") == [[r, r + 1] for r in range(0, 16, 2)]
    assert _lists(topo, "expert_data") == [list(range(0, 16, 2)), list(range(1, 16, 2))]


def test_with_tensor_parallelism_matches_deepspeeds_example() -> None:
    # DeepSpeed's E + M + D example: world 16, model degree 2, expert degree 4.
    topo = ds_moe.expert_topology(16, 4, tensor_parallel_size=2)
    assert _lists(topo, "expert") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert _lists(topo, "expert_data") == sorted([[r, r + 8] for r in range(8)])
    assert _lists(topo, "model") == [[r, r + 1] for r in range(0, 16, 2)]


def test_data_before_expert_layout() -> None:
    # D + E within each pipeline stage of 4 ranks: edp groups are contiguous, ep groups stride.
    topo = ds_moe.expert_topology(
        8, 2, pipeline_parallel_size=2, use_data_before_expert_parallel_=True
    )
    assert _lists(topo, "expert") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert _lists(topo, "expert_data") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _lists(topo, "pipe") == [[r, r + 4] for r in range(4)]


@pytest.mark.parametrize(
    ("world", "ep", "tp", "match"),
    [
        (4, 3, 1, "ep_size = 3 must divide the data-parallel size 4"),
        (8, 8, 2, "ep_size = 8 must divide the data-parallel size 4"),
        (6, 1, 4, "world size 6 is not divisible by tensor x pipeline parallel size 4 x 1"),
    ],
)
def test_layout_errors(world: int, ep: int, tp: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ds_moe.expert_topology(world, ep, tensor_parallel_size=tp)


def test_single_process_without_process_group() -> None:
    moe = ds_moe.MoE(4, nn.Linear(4, 4), num_experts=2)
    groups = ds_moe.configure_expert_parallelism(moe)
    group = groups["ep_size_1"]
    assert not groups.distributed and group.expert_parallel_group is None
    assert group.expert_parallel_ranks == (0,) and group.expert_data_parallel_ranks == (0,)
    with pytest.raises(ConfigError, match="ep_size = 2 must divide the data-parallel size 1"):
        groups.add(2)


def _ep_sizes(world_size: int) -> list[int]:
    return [ep for ep in (1, 2, 4) if ep <= world_size]


def _groups_body(rank: int, world_size: int) -> list:
    import ds_comm

    groups = ds_moe.ExpertParallelGroups()
    out = []
    for ep_size in _ep_sizes(world_size):
        group = groups.add(ep_size)
        assert groups.add(ep_size) is group  # created once
        for pg, ranks in (
            (group.expert_parallel_group, group.expert_parallel_ranks),
            (group.expert_data_parallel_group, group.expert_data_parallel_ranks),
        ):
            if len(ranks) == 1:
                assert pg is None  # nothing to communicate: no group created
                continue
            # The group holds exactly these ranks: an all-reduce of rank ids sums them.
            t = torch.tensor([float(rank)])
            ds_comm.all_reduce(t, group=pg)
            assert t.item() == sum(ranks)
        assert len(group.expert_parallel_ranks) == ep_size
        assert len(group.expert_data_parallel_ranks) == world_size // ep_size
        out.append((group.expert_parallel_ranks, group.expert_data_parallel_ranks))
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_groups_on_ranks(world_size: int) -> None:
    results = run_on_ranks(_groups_body, world_size)
    for rank, per_ep in enumerate(results):
        for ep_size, (ep_ranks, edp_ranks) in zip(_ep_sizes(world_size), per_ep, strict=True):
            start = rank - rank % ep_size
            assert ep_ranks == tuple(range(start, start + ep_size))
            assert edp_ranks == tuple(range(rank % ep_size, world_size, ep_size))


def _reduce_body(rank: int, world_size: int, *, ep_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 4), ds_moe.MoE(4, nn.Linear(4, 4), num_experts=4, ep_size=ep_size)
    )
    groups = ds_moe.configure_expert_parallelism(model)
    for p in model.parameters():
        p.grad = torch.full_like(p, float(rank + 1))
    model[0].bias.grad = None  # a missing gradient reduces as zeros
    ds_moe.all_reduce_gradients(model, groups)

    group = groups[f"ep_size_{ep_size}"]
    dense_mean = sum(r + 1 for r in range(world_size)) / world_size
    expert_mean = sum(r + 1 for r in group.expert_data_parallel_ranks) / world_size
    for name, p in model.named_parameters():
        if name == "0.bias":
            want = 0.0
        elif ds_moe.is_moe_param(p):
            want = expert_mean
        else:
            want = dense_mean
        torch.testing.assert_close(p.grad, torch.full_like(p, want), msg=name)


@pytest.mark.parametrize(("world_size", "ep_size"), [(1, 1), (2, 2), (4, 2), (4, 4)])
def test_all_reduce_gradients_uses_expert_data_parallel_group(
    world_size: int, ep_size: int
) -> None:
    run_on_ranks(_reduce_body, world_size, ep_size=ep_size)
