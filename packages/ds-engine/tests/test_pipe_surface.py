"""The pipeline engine's DeepSpeed methods on 2 stages: ``set_train_batch_size`` (micro-batches
per ``train_batch``), ``set_batch_fn``, ``set_dataloader``, ``eval_batch(num_micro_batches=)``,
``was_step_applied``, ``reset_activation_shape``, against the layers run in one process."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from ds_testing import run_on_ranks

DIM, ROWS = 4, 2


def _module(stages: int) -> Any:
    from ds_comm import PipeDataParallelTopology
    from ds_pipe import LayerSpec, PipelineModule

    return PipelineModule(
        [LayerSpec(nn.Linear, DIM, DIM), torch.tanh, LayerSpec(nn.Linear, DIM, 1)],
        topology=PipeDataParallelTopology(num_pp=stages, num_dp=1),
        loss_fn=nn.functional.mse_loss,
        seed_layers=True,
        base_seed=7,
        partition_method="uniform",
    )


def _reference() -> nn.Module:
    torch.manual_seed(7)
    first = nn.Linear(DIM, DIM)
    torch.manual_seed(9)
    last = nn.Linear(DIM, 1)
    return nn.Sequential(first, nn.Tanh(), last)


def _micro_batches(count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(ROWS, DIM, generator=gen), torch.randn(ROWS, 1, generator=gen))
        for _ in range(count)
    ]


def _pipe_body(rank: int, world_size: int) -> dict:
    import ds_engine

    cfg = {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, *_ = ds_engine.initialize(model=_module(world_size), config=cfg)
    ref = _reference()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    seen: list[int] = []

    def doubled(batch):  # set_batch_fn: post-processes each micro-batch
        seen.append(1)
        inputs, labels = batch
        return inputs, 2 * labels

    engine.set_batch_fn(doubled)
    losses = []
    for step, count in enumerate((2, 2, 3, 3)):
        if step == 2:
            engine.set_train_batch_size(3 * ROWS)  # 3 micro-batches per train_batch
        data = _micro_batches(count, seed=step)
        losses.append(float(engine.train_batch(iter(data))))
        ref_opt.zero_grad()
        total = 0.0
        for x, y in data:
            value = nn.functional.mse_loss(ref(x), 2 * y)
            (value / count).backward()
            total += float(value)
        ref_opt.step()
        assert math.isclose(losses[-1], total / count, rel_tol=1e-5), (losses[-1], total / count)
    applied = engine.was_step_applied()
    engine.reset_activation_shape()
    data = _micro_batches(4, seed=10)
    evaluated = float(engine.eval_batch(iter(data), num_micro_batches=4))
    with torch.no_grad():
        expected = sum(float(nn.functional.mse_loss(ref(x), 2 * y)) for x, y in data) / 4
    return {
        "batch_info": engine.get_batch_info(),
        "applied": applied,
        "micro_steps": engine.micro_steps,
        "eval": (evaluated, expected),
        "batch_fn_calls": len(seen) > 0
        if engine.is_first_stage() or engine.is_last_stage()
        else True,
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_pipeline_engine_methods(world_size: int) -> None:
    for got in run_on_ranks(_pipe_body, world_size, timeout=300):
        assert got["batch_info"] == (3 * ROWS, ROWS, 3)
        assert got["applied"] and got["micro_steps"] == 2 + 2 + 3 + 3
        assert got["eval"][0] == pytest.approx(got["eval"][1], rel=1e-5)
        assert got["batch_fn_calls"]
