"""Training through the engine on real gloo ranks: DeepSpeed's getting-started scripts under
``import ds_engine as deepspeed``, parity with single-process training, gradient accumulation
equivalence, fp16 overflow skipping and 1-bit optimizers that reduce their own gradients."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _engine_testing import config, loss_of, make_dataset, make_mlp, max_error, reference_adam


def _params_equal_across_ranks(model) -> bool:
    import torch

    import ds_comm

    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    gathered = torch.empty(flat.numel() * ds_comm.get_world_size())
    ds_comm.all_gather_into_tensor(gathered, flat)
    return all(torch.equal(c, flat) for c in gathered.chunk(ds_comm.get_world_size()))


def _getting_started_body(rank: int, world_size: int, *, config_path: str) -> tuple[float, float]:
    """DeepSpeed's getting-started loop, as written there (argparse, initialize, the loop)."""
    import argparse

    import torch

    import ds_engine as deepspeed

    parser = argparse.ArgumentParser(description="My training script.")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", config_path])
    deepspeed.init_distributed()
    net = make_mlp()
    model_engine, optimizer, trainloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=net.parameters(), training_data=make_dataset(128)
    )
    criterion = torch.nn.MSELoss()
    epoch_losses = []
    for _epoch in range(6):
        losses = []
        for data in trainloader:
            inputs, labels = data[0], data[1]
            outputs = model_engine(inputs)
            loss = criterion(outputs, labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.item())
        epoch_losses.append(sum(losses) / len(losses))
    steps = 6 * len(trainloader) // model_engine.gradient_accumulation_steps()
    assert model_engine.global_steps == steps
    assert model_engine.global_samples == steps * model_engine.train_batch_size()
    assert optimizer is model_engine.optimizer
    assert _params_equal_across_ranks(model_engine.module)
    return epoch_losses[0], epoch_losses[-1]


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 2])
def test_getting_started_script_trains(world_size: int, stage: int, tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    cfg = {
        "train_batch_size": 16,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 3e-2}},
        "zero_optimization": {"stage": stage, "overlap_comm": stage == 2},
        "steps_per_print": 1000,
    }
    path.write_text(json.dumps(cfg))
    results = run_on_ranks(_getting_started_body, world_size, config_path=str(path), timeout=300)
    for first, last in results:  # each rank's own micro-batches' loss
        assert last < 0.5 * first


def _parity_body(rank: int, world_size: int, *, stage: int, gas: int, clip: float) -> float:
    import torch

    import ds_engine

    micro, steps = 2, 5
    data = make_dataset(micro * gas * world_size * steps)
    rows = micro * gas * world_size
    batches = [[t[i * rows : (i + 1) * rows] for t in data.tensors] for i in range(steps)]
    reference = reference_adam(make_mlp(), batches, clip=clip)
    cfg = config(
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=gas,
        gradient_clipping=clip,
        zero_optimization={"stage": stage},
    )
    engine, *_ = ds_engine.initialize(model=make_mlp(), config=cfg)
    for batch in batches:
        chunks = [t.chunk(world_size * gas) for t in batch]
        for j in range(gas):
            engine.backward(loss_of(engine, [c[j * world_size + rank] for c in chunks]))
            engine.step()
    assert engine.global_steps == steps
    assert torch.isfinite(torch.tensor(engine.get_global_grad_norm()))
    return max_error(engine.module, reference)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize(("stage", "gas", "clip"), [(0, 1, 0.0), (1, 2, 0.5), (2, 3, 0.05)])
def test_engine_matches_single_process_adam(
    world_size: int, stage: int, gas: int, clip: float
) -> None:
    errors = run_on_ranks(_parity_body, world_size, stage=stage, gas=gas, clip=clip, timeout=300)
    assert max(errors) < 1e-5


def _accumulation_body(rank: int, world_size: int, *, stage: int) -> float:

    import ds_engine

    steps, global_rows = 4, 8 * world_size
    data = make_dataset(steps * global_rows)
    models = []
    for micro, gas in ((8, 1), (2, 4)):
        cfg = config(
            train_micro_batch_size_per_gpu=micro,
            gradient_accumulation_steps=gas,
            zero_optimization={"stage": stage},
        )
        engine, *_ = ds_engine.initialize(model=make_mlp(), config=cfg)
        assert engine.train_batch_size() == global_rows
        for step in range(steps):
            rows = [t[step * global_rows : (step + 1) * global_rows] for t in data.tensors]
            mine = [t.chunk(world_size)[rank] for t in rows]  # this rank's 8 rows
            for j in range(gas):
                boundary = engine.is_gradient_accumulation_boundary()
                assert boundary == (j == gas - 1)
                engine.backward(loss_of(engine, [t.chunk(gas)[j] for t in mine]))
                engine.step()
        models.append({n: p.detach().clone() for n, p in engine.module.named_parameters()})
    return max((models[0][n] - models[1][n]).abs().max().item() for n in models[0])


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 2])
def test_accumulation_equals_one_large_batch(world_size: int, stage: int) -> None:
    assert max(run_on_ranks(_accumulation_body, world_size, stage=stage, timeout=300)) < 1e-5


def _overflow_body(rank: int, world_size: int) -> dict:
    import torch

    import ds_engine

    cfg = config(
        fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
        scheduler={
            "type": "WarmupLR",
            "params": {"warmup_num_steps": 10, "warmup_min_lr": 1e-3, "warmup_max_lr": 1e-2},
        },
    )
    engine, *_ = ds_engine.initialize(model=make_mlp(), config=cfg)
    data = make_dataset(64)
    record: dict = {"scale": [], "lr": [], "changed": []}
    for step in range(4):
        before = [p.detach().clone() for p in engine.module.parameters()]
        x, y = (t[step * 8 + 4 * rank : step * 8 + 4 * rank + 4] for t in data.tensors)
        loss = torch.nn.functional.mse_loss(engine(x.half()).float(), y)
        if step == 2 and rank == world_size - 1:
            loss = loss * float("inf")  # only one rank overflows: every rank must skip
        engine.backward(loss)
        engine.step()
        record["changed"].append(
            any(not torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))
        )
        record["scale"].append(engine.optimizer.loss_scale)
        record["lr"].append(engine.get_lr()[0])
    assert engine.module[0].weight.dtype == torch.float16
    record["skipped"] = engine.skipped_steps
    record["global_steps"] = engine.global_steps
    return record


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_fp16_overflow_skips_the_step_on_every_rank(world_size: int) -> None:
    for record in run_on_ranks(_overflow_body, world_size, timeout=300):
        assert record["changed"] == [True, True, False, True]
        assert record["skipped"] == 1 and record["global_steps"] == 4
        assert record["scale"][2] == record["scale"][1] / 2
        assert record["lr"][2] == record["lr"][1]  # the schedule does not advance on a skip
        assert record["lr"][3] > record["lr"][2]


def _nan_body(rank: int, world_size: int) -> dict:
    import torch

    import ds_engine
    from ds_zero import GatheredParameters

    seen = {}
    for stage in (0, 1, 2, 3):
        cfg = config(zero_optimization={"stage": stage})
        engine, *_ = ds_engine.initialize(model=make_mlp(), config=cfg)
        data = make_dataset(32)
        record: dict = {"applied": [], "overflow": []}
        for step in range(3):
            x, y = (t[step * 8 + 4 * rank : step * 8 + 4 * rank + 4] for t in data.tensors)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            if step == 1 and rank == world_size - 1:
                loss = loss * float("nan")  # no loss scaler, one rank: every rank must skip
            engine.backward(loss)
            engine.step()
            record["applied"].append(engine.was_step_applied())
            record["overflow"].append(bool(engine.optimizer.overflow))
        with GatheredParameters(list(engine.module.parameters())):
            record["finite"] = all(bool(p.isfinite().all()) for p in engine.module.parameters())
        record["skipped"] = engine.skipped_steps
        record["global_steps"] = engine.global_steps
        seen[stage] = record
        engine.destroy()
    return seen


def test_a_nan_gradient_without_a_loss_scaler_skips_the_step_at_every_stage() -> None:
    for seen in run_on_ranks(_nan_body, 2, timeout=300):
        for stage, record in seen.items():
            assert record["applied"] == [True, False, True], stage
            assert record["overflow"] == [False, True, False], stage
            assert record["finite"] and record["skipped"] == 1, stage
            assert record["global_steps"] == 3, stage


def _onebit_body(rank: int, world_size: int) -> tuple[float, float, bool]:
    import ds_engine

    cfg = config(
        train_micro_batch_size_per_gpu=8,
        optimizer={"type": "OneBitAdam", "params": {"lr": 1e-2, "freeze_step": 4}},
    )
    engine, *_ = ds_engine.initialize(model=make_mlp(), config=cfg)
    assert engine.self_reducing
    data = make_dataset(8 * world_size * 30)
    losses = []
    for step in range(30):
        start = (step * world_size + rank) * 8
        loss = loss_of(engine, [t[start : start + 8] for t in data.tensors])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return sum(losses[:5]) / 5, sum(losses[-5:]) / 5, _params_equal_across_ranks(engine.module)


@pytest.mark.parametrize("world_size", [1, 2])
def test_optimizer_that_reduces_its_own_gradients_trains(world_size: int) -> None:
    for first, last, same in run_on_ranks(_onebit_body, world_size, timeout=300):
        assert last < 0.5 * first
        assert same
