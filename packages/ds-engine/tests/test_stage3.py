"""ZeRO stage 3 under the engine: the same losses as stage 0, models built under
``deepspeed.zero.Init``, checkpoints that resume on stage 3 or stage 2, and
``save_16bit_model``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _engine_testing import config, loss_of, make_dataset, make_mlp

STEPS = 6
RELATIVE_TOLERANCE = 1e-5  # fp32; stage 3 reduces in another order than stage 0


def _config(stage: int, **zero: object) -> dict:
    section = {"stage": stage, **zero}
    if stage == 3:  # the test model is tiny: partition every parameter
        section.setdefault("stage3_param_persistence_threshold", 0)
    return config(
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=2,
        gradient_clipping=1.0,
        zero_optimization=section,
        seed=7,
    )


def _engine(cfg: dict, *, seed: int = 0, zero_init: bool = False):
    import ds_engine

    if zero_init:
        with ds_engine.zero.Init(config_dict_or_path=cfg):
            model = make_mlp(seed)
        assert all(p.numel() == 0 and p.ds_numel > 0 for p in model.parameters())
    else:
        model = make_mlp(seed)
    engine, _, loader, _ = ds_engine.initialize(
        model=model, config=cfg, training_data=make_dataset(48)
    )
    return engine, _forever(loader)


def _forever(loader):
    while True:
        yield from loader


def _train(engine, batches, steps: int) -> list[float]:
    losses = []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        loss = loss_of(engine, next(batches))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(
        abs(x - y) <= RELATIVE_TOLERANCE * max(abs(y), 1e-12) for x, y in zip(a, b)
    )


def _parity_body(rank: int, world_size: int, *, zero_init: bool) -> bool:
    engine, batches = _engine(_config(0))
    reference = _train(engine, batches, STEPS)
    engine, batches = _engine(_config(3), zero_init=zero_init)
    assert engine.zero_optimization_stage() == 3
    losses = _train(engine, batches, STEPS)
    assert _close(losses, reference), (losses, reference)
    return True


@pytest.mark.parametrize("zero_init", [False, True])
def test_stage3_trains_as_stage_0(zero_init: bool) -> None:
    assert run_on_ranks(_parity_body, 2, zero_init=zero_init, timeout=300) == [True, True]


def _resume_body(rank: int, world_size: int, *, path: str, load_stage: int) -> bool:
    import torch

    torch.manual_seed(100 + rank)
    engine, batches = _engine(_config(3))
    uninterrupted = _train(engine, batches, STEPS)

    torch.manual_seed(100 + rank)
    engine, batches = _engine(_config(3))
    first = _train(engine, batches, STEPS // 2)
    engine.save_checkpoint(path)
    engine, _ = _engine(_config(load_stage), seed=3)  # other initial weights
    engine.load_checkpoint(path)
    assert engine.global_steps == STEPS // 2
    rest = _train(engine, _forever(engine.training_dataloader), STEPS - STEPS // 2)
    assert _close(first + rest, uninterrupted), (first + rest, uninterrupted)
    return True


@pytest.mark.parametrize("load_stage", [3, 2])
def test_stage3_checkpoint_resumes_on_stage_3_and_2(load_stage: int, tmp_path: Path) -> None:
    kwargs = {"path": str(tmp_path / "ckpt"), "load_stage": load_stage}
    assert run_on_ranks(_resume_body, 2, timeout=300, **kwargs) == [True, True]


def _save_16bit_body(rank: int, world_size: int, *, path: str) -> bool:
    import torch

    import ds_engine

    engine, batches = _engine(_config(3))
    _train(engine, batches, 1)
    assert engine.save_16bit_model(path, "off.bin") is False  # the gather flag is off
    assert not (Path(path) / "off.bin").exists()
    engine, batches = _engine(_config(3, stage3_gather_16bit_weights_on_model_save=True))
    _train(engine, batches, 2)
    assert engine.save_16bit_model(path) is True
    saved = torch.load(Path(path) / "pytorch_model.bin", weights_only=True)
    params = list(engine.module.parameters())
    with ds_engine.zero.GatheredParameters(params):
        expected = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    assert saved.keys() == expected.keys()
    assert all(torch.equal(saved[k], expected[k]) for k in saved)
    plain = make_mlp(0)
    plain.load_state_dict(saved)  # a plain torch module takes it as is
    return True


def test_save_16bit_model_gathers_stage3_weights(tmp_path: Path) -> None:
    assert run_on_ranks(_save_16bit_body, 2, path=str(tmp_path), timeout=300) == [True, True]


def _module_only_body(rank: int, world_size: int, *, path: str, load_stage: int) -> bool:
    import torch

    import ds_engine

    def weights(engine) -> dict[str, torch.Tensor]:
        with ds_engine.zero.GatheredParameters(list(engine.module.parameters())):
            return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}

    engine, batches = _engine(_config(3))
    _train(engine, batches, 2)
    engine.save_checkpoint(path)
    expected = weights(engine)
    engine, batches = _engine(_config(load_stage), seed=3)
    engine.load_checkpoint(path, load_module_only=True)
    assert engine.global_steps == 0  # module only: no counters, no optimizer state
    loaded = weights(engine)
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
    _train(engine, batches, 1)  # the masters follow the loaded weights
    return True


@pytest.mark.parametrize("load_stage", [3, 0])
def test_stage3_checkpoint_loads_module_only(load_stage: int, tmp_path: Path) -> None:
    kwargs = {"path": str(tmp_path / "ckpt"), "load_stage": load_stage}
    assert run_on_ranks(_module_only_body, 2, timeout=300, **kwargs) == [True, True]


def _save_16bit_with_buffers_body(rank: int, world_size: int, *, path: str) -> bool:
    import torch
    from _engine_testing import OUT

    import ds_engine

    model = torch.nn.Sequential(make_mlp(0), torch.nn.BatchNorm1d(OUT))  # a 0-d buffer too
    cfg = _config(3, stage3_gather_16bit_weights_on_model_save=True)
    engine, _, loader, _ = ds_engine.initialize(
        model=model, config=cfg, training_data=make_dataset(48)
    )
    _train(engine, _forever(loader), 1)
    assert engine.save_16bit_model(path) is True
    saved = torch.load(Path(path) / "pytorch_model.bin", weights_only=True)
    assert saved["1.num_batches_tracked"].ndim == 0
    plain = torch.nn.Sequential(make_mlp(0), torch.nn.BatchNorm1d(OUT))
    plain.load_state_dict(saved)
    return True


def test_save_16bit_model_keeps_buffers(tmp_path: Path) -> None:
    run_on_ranks(_save_16bit_with_buffers_body, 2, path=str(tmp_path), timeout=300)
