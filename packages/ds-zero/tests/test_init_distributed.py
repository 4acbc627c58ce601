"""zero.Init creates the default process group from the launcher's environment when none exists,
as DeepSpeed's does (scripts build the model under Init before deepspeed.initialize)."""

from __future__ import annotations

from ds_testing import run_on_ranks


def _init_without_group_body(rank: int, world_size: int) -> tuple[bool, int, int, list[int]]:
    import torch
    import torch.distributed as dist

    import ds_comm
    from ds_zero import Init

    before = dist.is_initialized()
    try:
        with Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
            layer = torch.nn.Linear(8, 4, bias=False)
        shard = layer.weight.ds_tensor.numel()  # this rank's slice of the 32 elements
        return before, ds_comm.get_world_size(), ds_comm.get_rank(), [shard]
    finally:
        if dist.is_initialized():
            ds_comm.destroy_process_group()


def test_init_creates_the_process_group_from_the_environment() -> None:
    results = run_on_ranks(_init_without_group_body, 2, init_process_group=False)
    for rank, (before, world, got_rank, shards) in enumerate(results):
        assert before is False
        assert (world, got_rank) == (2, rank)
        assert shards == [16]  # partitioned over the 2 ranks the environment named


def _disabled_body(rank: int, world_size: int) -> bool:
    import torch
    import torch.distributed as dist

    from ds_zero import Init

    with Init(enabled=False):
        torch.nn.Linear(2, 2)
    return dist.is_initialized()


def test_a_disabled_init_leaves_distributed_alone() -> None:
    assert run_on_ranks(_disabled_body, 1, init_process_group=False) == [False]
