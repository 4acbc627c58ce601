"""The engine's DeepSpeed methods: client optimizers and schedulers (objects or callables),
``no_sync``, ``scale_wrt_gas``, the boundary override, accessors, ``deepspeed_io`` and
``memory_breakdown``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _engine_testing import config, loss_of, make_dataset, make_mlp


def _client_objects_body(rank: int, world_size: int) -> list[float]:
    import torch

    import ds_engine

    cfg = config()
    del cfg["optimizer"]
    model = make_mlp()
    engine, optimizer, loader, scheduler = ds_engine.initialize(
        model=model,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        config=cfg,
    )
    assert loader is None and isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
    assert optimizer is engine.optimizer and isinstance(optimizer.optimizer, torch.optim.SGD)
    assert engine.get_mom() == [0.9]
    data = make_dataset(8)
    lrs = []
    for _ in range(3):
        engine.backward(loss_of(engine, [t[:4] for t in data.tensors]))
        engine.step()
        lrs.append(engine.get_lr()[0])
    with pytest.raises(ds_engine.ConfigError, match="both a client optimizer"):
        ds_engine.initialize(model=make_mlp(), optimizer=torch.optim.SGD, config=config())
    return lrs


@pytest.mark.parametrize("world_size", [1, 2])
def test_client_optimizer_and_scheduler_callables(world_size: int) -> None:
    for lrs in run_on_ranks(_client_objects_body, world_size):
        assert lrs == pytest.approx([0.05, 0.025, 0.0125])


def _no_sync_body(rank: int, world_size: int) -> float:
    import torch

    import ds_engine

    data = make_dataset(8 * world_size)
    mine = [t.chunk(world_size)[rank] for t in data.tensors]
    halves = [[t[:4] for t in mine], [t[4:] for t in mine]]
    results = []
    for mode in ("accumulate", "no_sync"):
        cfg = config(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
        engine, *_ = ds_engine.initialize(model=make_mlp(), config=cfg)
        if mode == "accumulate":
            for half in halves:
                engine.backward(loss_of(engine, half))
                engine.step()
        else:
            with engine.no_sync():  # the first micro-batch accumulates without reducing
                engine.backward(loss_of(engine, halves[0]))
            engine.step()
            engine.backward(loss_of(engine, halves[1]))
            engine.step()
        assert engine.global_steps == 1
        results.append(torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()]))
    return (results[0] - results[1]).abs().max().item()


@pytest.mark.parametrize("world_size", [1, 2])
def test_no_sync_accumulates_then_reduces_once(world_size: int) -> None:
    assert max(run_on_ranks(_no_sync_body, world_size)) < 1e-6


def _stage2_no_sync_body(rank: int, world_size: int) -> str:
    import ds_engine

    engine, *_ = ds_engine.initialize(
        model=make_mlp(), config=config(zero_optimization={"stage": 2})
    )
    try:
        with engine.no_sync():
            pass
    except RuntimeError as exc:
        return str(exc)
    return "allowed"


def test_no_sync_is_refused_under_stage_2() -> None:
    assert "incompatible with ZeRO stage 2" in run_on_ranks(_stage2_no_sync_body, 1)[0]


def _scale_body(rank: int, world_size: int) -> float:
    import torch

    import ds_engine

    data = make_dataset(8)
    batches = [[t[:4] for t in data.tensors], [t[4:] for t in data.tensors]]
    params = []
    for scale_wrt_gas in (True, False):
        cfg = config(
            gradient_accumulation_steps=2, optimizer={"type": "SGD", "params": {"lr": 0.1}}
        )
        engine, *_ = ds_engine.initialize(model=make_mlp(), config=cfg)
        for batch in batches:
            loss = loss_of(engine, batch)
            engine.backward(loss if scale_wrt_gas else loss / 2, scale_wrt_gas=scale_wrt_gas)
            engine.step()
        params.append(torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()]))
    return (params[0] - params[1]).abs().max().item()


def test_scale_wrt_gas_false_leaves_the_loss_unscaled() -> None:
    assert run_on_ranks(_scale_body, 1)[0] < 1e-6


def _accessors_body(rank: int, world_size: int) -> dict:
    import ds_engine

    cfg = config(
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=3,
        bf16={"enabled": True},
        zero_optimization={"stage": 1},
    )
    engine, _, loader, _ = ds_engine.initialize(
        model=make_mlp(), config=cfg, training_data=make_dataset(24)
    )
    engine.set_gradient_accumulation_boundary(True)
    assert engine.is_gradient_accumulation_boundary()
    engine.set_gradient_accumulation_boundary(None)
    assert not engine.is_gradient_accumulation_boundary()
    other = engine.deepspeed_io(make_dataset(24), batch_size=3)
    breakdown = engine.memory_usage()
    engine.eval()
    evaluating = not engine.module.training
    engine.train()
    return {
        "triad": (
            engine.train_batch_size(),
            engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps(),
        ),
        "precision": (engine.fp16_enabled(), engine.bfloat16_enabled()),
        "stage": engine.zero_optimization_stage(),
        "loader": (len(loader), len(other), len(next(iter(other))[0])),
        "params_bytes": breakdown.params,
        "eval": evaluating and engine.module.training,
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_accessors_loader_and_memory(world_size: int) -> None:
    for got in run_on_ranks(_accessors_body, world_size):
        assert got["triad"] == (2 * 3 * world_size, 2, 3)
        assert got["precision"] == (False, True)
        assert got["stage"] == 1
        per_rank = 24 // world_size
        assert got["loader"] == (per_rank // 2, -(-per_rank // 3), 3)
        numel = sum(p.numel() for p in make_mlp().parameters())
        assert got["params_bytes"] >= 2 * numel  # bf16 weights (plus alignment padding)
        assert got["eval"]
