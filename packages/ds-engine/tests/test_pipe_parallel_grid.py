"""The pipeline's groups come from ds-comm's one ``ParallelGrid``: on 4 gloo ranks, pp=2 x dp=2,
every axis of a freshly built ``ParallelGrid(pp=2, dp=2)`` names the same ranks as the
``PipelineModule``'s grid, DeepSpeed's ``PipelineParallelGrid`` and ``deepspeed.utils.groups``
after ``initialize()``; the module's groups ARE its grid's; and the pipeline still trains like the
same layers in one process."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ds_testing import run_on_ranks

DIM, ROWS, GAS, SEED = 4, 2, 2, 77
# grid axis -> DeepSpeed topology axis (None: the topology has no such axis)
AXES = {"pp": "pipe", "dp": "data", "tp": "model", "sp": None, "ep": None, "edp": None}


def _layers() -> list[Any]:
    from ds_pipe import LayerSpec

    return [LayerSpec(nn.Linear, DIM, DIM), torch.tanh, LayerSpec(nn.Linear, DIM, 1)]


def _reference() -> nn.Module:
    """The layers in one process, seeded as ``seed_layers=True`` seeds them."""
    torch.manual_seed(SEED)
    first = nn.Linear(DIM, DIM)
    torch.manual_seed(SEED + 2)
    return nn.Sequential(first, nn.Tanh(), nn.Linear(DIM, 1))


def _batch(step: int, mb: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + 10 * mb + replica)
    return torch.randn(ROWS, DIM, generator=gen), torch.randn(ROWS, 1, generator=gen)


def _members(group: Any) -> int:
    """The sum of the global ranks in ``group``: proof of who it spans."""
    import ds_comm

    t = torch.tensor([float(ds_comm.get_rank())])
    ds_comm.all_reduce(t, group=group)
    return int(t.item())


def _views(module: Any, pipe_grid: Any, axis: str) -> dict[str, Any]:
    """The ranks (and group sums) each view gives for one grid axis."""
    from ds_engine.utils import groups

    name = AXES[axis]
    seen: dict[str, Any] = {"module.parallel_grid": module.parallel_grid.ranks_of(axis)}
    if name is not None:
        seen["module.grid"] = module.grid.get_ranks(name)
        seen["same_group"] = module.grid.get_group(name) is module.parallel_grid.get_group(axis)
    accessors = {
        "pp": (groups._get_pipe_parallel_group, groups._get_pipe_parallel_world_size),
        "dp": (groups._get_data_parallel_group, groups._get_data_parallel_world_size),
        "tp": (groups.get_tensor_model_parallel_group, groups.get_tensor_model_parallel_world_size),
        "sp": (groups._get_sequence_parallel_group, groups._get_sequence_parallel_world_size),
    }
    if axis in accessors:
        group, size = accessors[axis]
        seen["groups"] = (_members(group()), size())
        seen["groups_same"] = group() is module.parallel_grid.get_group(axis)
    pipe = {
        "pp": (pipe_grid.pp_group, pipe_grid.get_pipe_parallel_group()),
        "dp": (pipe_grid.get_data_parallel_group_ranks(), pipe_grid.get_data_parallel_group()),
        "tp": (pipe_grid.slice_group, pipe_grid.get_slice_parallel_group()),
    }
    if axis in pipe:
        ranks, group = pipe[axis]
        seen["PipelineParallelGrid"] = (list(ranks), _members(group))
    return seen


def _body(rank: int, world_size: int) -> dict[str, Any]:
    import ds_comm
    import ds_engine
    from ds_engine.runtime.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid
    from ds_pipe import PipelineModule

    topology = PipeDataParallelTopology(num_pp=2, num_dp=2)
    module = PipelineModule(
        _layers(),
        topology=topology,
        loss_fn=nn.functional.mse_loss,
        seed_layers=True,
        base_seed=SEED,
        partition_method="uniform",
    )
    config = {
        "train_batch_size": ROWS * GAS * 2,
        "train_micro_batch_size_per_gpu": ROWS,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "gradient_clipping": 1.0,
    }
    engine, _, _, _ = ds_engine.initialize(config=config, model=module)
    fresh = ds_comm.ParallelGrid(pp=2, dp=2)
    pipe_grid = PipelineParallelGrid(topology)
    out: dict[str, Any] = {
        "fresh": {a: fresh.ranks_of(a) for a in (*AXES, "replica", "sequence_data_parallel")},
        "views": {a: _views(module, pipe_grid, a) for a in AXES},
        "replica": (
            module.parallel_grid.ranks_of("replica"),
            pipe_grid.get_model_parallel_world_size(),
            _members(pipe_grid.get_model_parallel_group()),
        ),
        "coords": [tuple(topology.get_coord(r)) for r in range(world_size)],
        "grid_coords": [fresh.layout.coord(r) for r in range(world_size)],
    }
    ref = _reference()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    replica = module.grid.axis_rank("data")
    losses = []
    for step in range(3):
        data = [[_batch(step, mb, r) for mb in range(GAS)] for r in range(2)]
        loss = engine.train_batch(iter(data[replica]))
        opt.zero_grad()
        total = 0.0
        for x, y in (pair for batch in data for pair in batch):
            value = nn.functional.mse_loss(ref(x), y)
            (value / (GAS * 2)).backward()
            total += float(value.detach())
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        losses.append((float(loss), total / (GAS * 2)))
    out["losses"] = losses
    out["refused"] = _refusals()
    return out


def _refusals() -> list[str]:
    """A pipeline topology with an axis the grid does not have is refused, naming it."""
    from ds_comm import ProcessTopology
    from ds_engine.runtime.pipe.topology import PipelineParallelGrid
    from ds_pipe import PipelineModule

    topology = ProcessTopology(["pipe", "data", "expert"], [2, 2, 1])
    messages = []
    for build in (
        lambda: PipelineModule(_layers(), topology=topology, loss_fn=nn.functional.mse_loss),
        lambda: PipelineParallelGrid(topology),
    ):
        try:
            build()
        except NotImplementedError as error:
            messages.append(str(error))
    return messages


def test_pipeline_groups_are_the_parallel_grids_on_pp2_dp2() -> None:
    results = run_on_ranks(_body, 4)
    for rank, res in enumerate(results):
        fresh, views = res["fresh"], res["views"]
        # pp=2 x dp=2: stages are ranks {0, 1} and {2, 3}; replicas {0, 2} and {1, 3}
        assert fresh["pp"] == [rank % 2, rank % 2 + 2]
        assert fresh["dp"] == [rank - rank % 2, rank - rank % 2 + 1]
        for axis in ("tp", "sp", "ep"):
            assert fresh[axis] == [rank]
        assert fresh["edp"] == fresh["dp"] == fresh["sequence_data_parallel"]
        for axis, seen in views.items():
            assert seen["module.parallel_grid"] == fresh[axis], (rank, axis)
            if "module.grid" in seen:
                assert seen["module.grid"] == fresh[axis] and seen["same_group"], (rank, axis)
            if "groups" in seen:
                assert seen["groups"] == (sum(fresh[axis]), len(fresh[axis])), (rank, axis)
                assert seen["groups_same"], (rank, axis)
            if "PipelineParallelGrid" in seen:
                assert seen["PipelineParallelGrid"] == (fresh[axis], sum(fresh[axis])), (rank, axis)
        # DeepSpeed's model-parallel group of the pipeline grid: the replica (pipe x model)
        assert res["replica"] == (fresh["replica"], 2, sum(fresh["replica"]))
        assert fresh["replica"] == fresh["pp"]
        # one rank arithmetic: the topology's coordinates are the grid's
        for coord, grid_coord in zip(res["coords"], res["grid_coords"]):
            assert coord == (grid_coord["pp"], grid_coord["dp"])
        assert len(res["refused"]) == 2
        assert all("['expert']" in m and "not implemented" in m for m in res["refused"])
        for got, want in res["losses"]:
            assert math.isclose(got, want, rel_tol=1e-5), res["losses"]


def _expert_body(rank: int, world_size: int) -> dict[str, Any]:
    import ds_comm
    import ds_engine
    import ds_moe
    from ds_engine.utils import groups

    grid = ds_comm.ParallelGrid(dp=4, ep=2)
    moe = nn.Sequential(ds_moe.MoE(hidden_size=4, expert=nn.Linear(4, 4), num_experts=2, ep_size=2))
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {}}}
    ds_engine.initialize(model=moe, config=config, mpu=grid.mpu())
    try:
        return {
            "grid": groups.get_parallel_grid() is grid,
            "same": [
                groups._get_expert_parallel_group("ep_size_2") is grid.get_group("ep"),
                groups._get_expert_data_parallel_group("ep_size_2") is grid.get_group("edp"),
                groups._get_data_parallel_group() is grid.get_group("dp"),
            ],
            "ranks": (
                list(groups._get_expert_parallel_group_ranks("ep_size_2")),
                list(groups._get_expert_data_parallel_group_ranks("ep_size_2")),
            ),
            "want": (grid.ranks_of("ep"), grid.ranks_of("edp")),
        }
    finally:
        groups.mpu = None


def test_engine_expert_groups_are_its_grids_on_four_ranks() -> None:
    for rank, res in enumerate(run_on_ranks(_expert_body, 4)):
        assert res["grid"] and all(res["same"]), (rank, res)
        assert (
            res["ranks"]
            == res["want"]
            == ([rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2])
        )
