"""Param groups reduced and sharded over their own process group (``param_group_process_groups``,
what MoE expert parameters need): on real gloo ranks, against a single-process reference."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_testing import run_on_ranks

DIM, EP = 6, 2


class _DenseAndExpert(nn.Module):
    """A dense layer shared by every rank plus one "expert" that ranks ``r % EP`` share."""

    def __init__(self, expert_seed: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(DIM, DIM)
        torch.manual_seed(expert_seed)
        self.expert = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.expert(torch.tanh(self.dense(x)))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(5, DIM, generator=gen), torch.randn(5, DIM, generator=gen)


def _loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = _batch(step, rank)
    return nn.functional.mse_loss(model(x), y)


def _expert_data_groups(world_size: int) -> object:
    """Ranks holding the same expert (``r % EP``), created on every rank in the same order."""
    import ds_comm

    if world_size == 1:
        return None
    mine = None
    for e in range(EP):
        group = ds_comm.new_group(list(range(e, world_size, EP)))
        if ds_comm.get_rank() % EP == e:
            mine = group
    return mine


def _groups_body(rank: int, world_size: int, *, stage: int, steps: int) -> float:
    from ds_zero import ZeroConfig, ZeroOptimizer

    ep = min(EP, world_size)
    # The reference: both experts in one process; rank r's loss uses expert r % EP, and the
    # gradient is that of the mean loss over all ranks.
    dense_ref = _DenseAndExpert(expert_seed=1)
    experts = [_DenseAndExpert(expert_seed=1 + e).expert for e in range(ep)]
    params = [*dense_ref.dense.parameters(), *(p for e in experts for p in e.parameters())]
    reference = torch.optim.Adam(params, lr=1e-2)
    for step in range(steps):
        reference.zero_grad()
        total = sum(
            nn.functional.mse_loss(experts[r % ep](torch.tanh(dense_ref.dense(x))), y)
            for r in range(world_size)
            for x, y in [_batch(step, r)]
        )
        (total / world_size).backward()
        reference.step()

    model = _DenseAndExpert(expert_seed=1 + rank % ep)
    optimizer = torch.optim.Adam(
        [{"params": model.dense.parameters()}, {"params": model.expert.parameters()}], lr=1e-2
    )
    zero = ZeroOptimizer(
        model,
        optimizer,
        ZeroConfig(stage=stage, reduce_bucket_size=16),
        param_group_process_groups=[None, _expert_data_groups(world_size)],
    )
    for step in range(steps):
        zero.backward(_loss(model, step, rank))
        zero.step()
    pairs = [(model.dense, dense_ref.dense), (model.expert, experts[rank % ep])]
    worst = 0.0
    for mine, ref in pairs:
        for a, b in zip(mine.parameters(), ref.parameters()):
            worst = max(worst, ((a - b).abs().max() / b.abs().max()).item())
    return worst


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_param_group_on_its_own_process_group_matches_reference(
    world_size: int, stage: int
) -> None:
    errors = run_on_ranks(_groups_body, world_size, stage=stage, steps=3, timeout=300)
    assert max(errors) < 1e-5


def test_one_process_group_per_param_group_is_required() -> None:
    from ds_zero import ZeroOptimizer

    model = _DenseAndExpert(expert_seed=1)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="1 optimizer param groups"):
        ZeroOptimizer(model, optimizer, param_group_process_groups=[None, None])


def _stage3_groups_body(rank: int, world_size: int, *, steps: int) -> dict[str, float]:
    """ZeRO-3 with the expert on its own (expert-data-parallel) group against the one-process
    reference and against stage 2 with the same groups, step by step, clipping active."""
    from ds_zero import GatheredParameters, ZeroConfig, build_zero_optimizer

    ep, clip = min(EP, world_size), 0.05
    dense_ref = _DenseAndExpert(expert_seed=1)
    experts = [_DenseAndExpert(expert_seed=1 + e).expert for e in range(ep)]
    params = [*dense_ref.dense.parameters(), *(p for e in experts for p in e.parameters())]
    reference = torch.optim.Adam(params, lr=1e-2)
    ref_norms = []
    for step in range(steps):
        reference.zero_grad()
        total = sum(
            nn.functional.mse_loss(experts[r % ep](torch.tanh(dense_ref.dense(x))), y)
            for r in range(world_size)
            for x, y in [_batch(step, r)]
        )
        (total / world_size).backward()
        # every element once: the dense layer and each expert (not once per replica)
        ref_norms.append(float(nn.utils.clip_grad_norm_(params, clip)))
        reference.step()

    edp = _expert_data_groups(world_size)
    runs = []
    for stage in (2, 3):
        model = _DenseAndExpert(expert_seed=1 + rank % ep)
        optimizer = torch.optim.Adam(
            [{"params": model.dense.parameters()}, {"params": model.expert.parameters()}],
            lr=1e-2,
        )
        config = ZeroConfig(
            stage=stage, reduce_bucket_size=16, stage3_param_persistence_threshold=8
        )
        zero = build_zero_optimizer(
            model,
            optimizer,
            config,
            gradient_clipping=clip,
            param_group_process_groups=[None, edp],
        )
        norms, values = [], []
        for step in range(steps):
            zero.backward(_loss(model, step, rank))
            zero.step()
            norms.append(zero.get_global_grad_norm())
            with GatheredParameters(list(model.parameters())):
                values.append([p.detach().clone() for p in model.parameters()])
        runs.append((norms, values))
    (norms2, values2), (norms3, values3) = runs
    ref_values = [*dense_ref.dense.parameters(), *experts[rank % ep].parameters()]
    return {
        "norm_vs_ref": max(abs(a - b) / b for a, b in zip(norms3, ref_norms)),
        "norm_vs_stage2": max(abs(a - b) / b for a, b in zip(norms3, norms2)),
        "stage3_vs_stage2": max(
            (a - b).abs().max().item() for s2, s3 in zip(values2, values3) for a, b in zip(s2, s3)
        ),
        "stage3_vs_ref": max(
            ((a - b).abs().max() / b.abs().max()).item() for a, b in zip(values3[-1], ref_values)
        ),
        "expert_shard": float(model.expert.weight.ds_tensor.numel()),
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_stage3_param_group_on_its_own_process_group(world_size: int) -> None:
    """Stage 3 partitions the expert over its expert-data-parallel group (4 ranks: 2 ranks per
    expert, so half of its 36 weights each; 2 ranks: the whole expert), reduces it there and
    matches stage 2 step by step (1e-6) and the one-process reference (1e-5), norm included."""
    results = run_on_ranks(_stage3_groups_body, world_size, steps=3, timeout=300)
    for r in results:
        assert r["norm_vs_ref"] < 1e-5 and r["norm_vs_stage2"] < 1e-6, r
        assert r["stage3_vs_stage2"] < 1e-6 and r["stage3_vs_ref"] < 1e-5, r
        assert r["expert_shard"] == DIM * DIM / (world_size // EP), r


def _init_refused_body(rank: int, world_size: int) -> str:
    from ds_zero import Init, Stage3Optimizer, ZeroConfig

    with Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
        model = _DenseAndExpert(expert_seed=1 + rank)
    optimizer = torch.optim.Adam(
        [{"params": model.dense.parameters()}, {"params": model.expert.parameters()}], lr=1e-2
    )
    edp = _expert_data_groups(world_size)
    try:
        Stage3Optimizer(
            model, optimizer, ZeroConfig(stage=3), param_group_process_groups=[None, edp]
        )
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_stage3_refuses_experts_partitioned_under_init() -> None:
    """Experts built under ``ds_zero.Init`` are partitioned over the whole data-parallel group
    (each rank's expert differs): refused, naming them, instead of mixing experts' shards."""
    for message in run_on_ranks(_init_refused_body, 2):
        assert "['expert.weight', 'expert.bias']" in message and "ds_zero.Init" in message
