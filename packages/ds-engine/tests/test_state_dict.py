"""The engine's state dicts: ``module_state_dict``, ``load_module_state_dict`` and, under ZeRO-3,
``_zero3_consolidated_16bit_state_dict`` (what transformers' Trainer saves) against the
single-process model's state dict, on 1, 2 and 4 ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _engine_testing import config, loss_of, make_dataset, make_mlp, reference_adam


def _stage3() -> dict:
    return config(
        zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0},
    )


def _max_diff(state: dict, expected: dict) -> float:
    assert list(state) == list(expected)
    return max(float((state[k].float() - expected[k].float()).abs().max()) for k in expected)


def _zero3_body(rank: int, world_size: int) -> dict:
    import torch

    import ds_engine

    engine, *_ = ds_engine.initialize(model=make_mlp(), config=_stage3())
    partitioned = all(p.numel() == 0 for p in engine.module.parameters())
    initial = engine._zero3_consolidated_16bit_state_dict()
    batches = [list(make_dataset(4 * world_size, seed=s).tensors) for s in (1, 2)]
    for batch in batches:
        engine.backward(loss_of(engine, [t.chunk(world_size)[rank] for t in batch]))
        engine.step()
    trained = engine._zero3_consolidated_16bit_state_dict()
    reference = reference_adam(make_mlp(), batches)
    other = make_mlp(seed=5)
    engine.load_module_state_dict({"module": other.state_dict()}, fetch_z3_params=True)
    # The fp32 masters follow the loaded weights: a step at lr 0 publishes them unchanged.
    for group in engine.basic_optimizer.param_groups:
        group["lr"] = 0.0
    engine.backward(loss_of(engine, [t.chunk(world_size)[rank] for t in batches[0]]))
    engine.step()
    loaded = engine._zero3_consolidated_16bit_state_dict()
    x = batches[0][0]
    with torch.no_grad():
        same_forward = torch.allclose(engine(x), other(x), atol=1e-6)
    module_keys = list(engine.module_state_dict())
    with torch.no_grad(), ds_engine.zero.GatheredParameters(list(engine.module.parameters())):
        engine.empty_partition_cache()  # releases what the context gathered, early
        released = all(p.numel() == 0 for p in engine.module.parameters())
    with torch.no_grad():
        still_runs = torch.allclose(engine(x), other(x), atol=1e-6)
    dispatched = engine._consolidated_16bit_state_dict()  # accelerate's entry point
    out = {"partitioned": partitioned, "none_elsewhere": rank == 0 or initial is None}
    out["dispatched"] = rank != 0 or _max_diff(dispatched, loaded) == 0.0
    out["same_forward"] = same_forward and still_runs
    out["released"] = released
    out["module_keys"] = module_keys == list(other.state_dict())
    if rank == 0:
        out["initial"] = _max_diff(initial, make_mlp().state_dict())
        out["trained"] = _max_diff(trained, reference)
        out["loaded"] = _max_diff(loaded, other.state_dict())
        out["on_cpu"] = all(t.device.type == "cpu" for t in trained.values())
    return out


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_zero3_consolidated_state_dict_is_the_whole_model(world_size: int) -> None:
    results = run_on_ranks(_zero3_body, world_size, timeout=600)
    for got in results:
        assert got["partitioned"] and got["none_elsewhere"]
        assert got["same_forward"] and got["module_keys"] and got["released"]
        assert got["dispatched"]
    first = results[0]
    assert first["initial"] == 0.0 and first["loaded"] == 0.0 and first["on_cpu"]
    assert first["trained"] < 1e-5


def _stage0_body(rank: int, world_size: int) -> dict:
    import torch

    import ds_engine

    model = make_mlp()
    model[0].bias.requires_grad_(False)
    engine, *_ = ds_engine.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=config(),
    )
    with pytest.raises(ValueError, match="requires ZeRO-3"):
        engine._zero3_consolidated_16bit_state_dict()
    with pytest.raises(ValueError, match="only where weights are partitioned"):
        engine._consolidated_16bit_state_dict()
    full = engine.module_state_dict(prefix="m.")
    trainable = engine.module_state_dict(exclude_frozen_parameters=True)
    calls = []
    other = make_mlp(seed=7)

    def custom(src, dst):
        calls.append(sorted(src))
        dst.load_state_dict(src)

    engine.load_module_state_dict({"module": other.state_dict()}, custom_load_fn=custom)
    custom_loaded = torch.equal(engine.module[3].weight, other[3].weight)
    partial = {k: v for k, v in make_mlp(seed=9).state_dict().items() if k != "3.bias"}
    with pytest.raises(RuntimeError):
        engine.load_module_state_dict({"module": partial})
    engine.load_module_state_dict({"module": partial}, allowed_missing_keys=["3.bias"])
    # The fp32 masters follow the loaded weights: a zero-gradient step leaves them unchanged.
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.backward(loss_of(engine, list(make_dataset(4).tensors)) * 0.0)
    engine.step()
    after = engine.module.state_dict()
    return {
        "full": sorted(full),
        "trainable": sorted(trainable),
        "custom": (calls, custom_loaded),
        "kept": all(torch.equal(before[k], after[k]) for k in before),
        "loaded_partial": torch.equal(after["0.weight"], partial["0.weight"]),
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_module_state_dict_and_load_module_state_dict(world_size: int) -> None:
    for got in run_on_ranks(_stage0_body, world_size, timeout=300):
        assert got["full"] == ["m.0.bias", "m.0.weight", "m.3.bias", "m.3.weight"]
        assert got["trainable"] == ["0.weight", "3.bias", "3.weight"]
        assert got["custom"] == ([["0.bias", "0.weight", "3.bias", "3.weight"]], True)
        assert got["kept"] and got["loaded_partial"]


def _custom_load_body(rank: int, world_size: int, path: str) -> dict:
    import ds_engine

    engine, *_ = ds_engine.initialize(model=make_mlp(), config=config())
    engine.save_checkpoint(path, tag="t")
    calls = []

    def custom(src, dst):
        calls.append((sorted(src), dst is engine.module))
        dst.load_state_dict(src)

    loaded, _ = engine.load_checkpoint(path, tag="t", custom_load_fn=custom)
    return {"calls": calls, "loaded": loaded is not None}


@pytest.mark.parametrize("world_size", [1, 2])
def test_load_checkpoint_custom_load_fn(world_size: int, tmp_path: Path) -> None:
    for got in run_on_ranks(_custom_load_body, world_size, path=str(tmp_path), timeout=300):
        keys = ["0.bias", "0.weight", "3.bias", "3.weight"]
        assert got == {"calls": [(keys, True)], "loaded": True}
