"""The engine's DeepSpeed surface: every public name of DeepSpeed 0.19.8's ``DeepSpeedEngine`` and
``PipelineEngine`` exists (or is one of the deliberately absent names, which say why), the
generated config accessors, ``initialize()``'s signature and legacy config names, the monitor,
``compile`` and teardown."""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _deepspeed_surface import (
    CLIENT_PRIVATE_METHODS,
    ENGINE_ATTRIBUTES,
    ENGINE_METHODS,
    ENGINE_SIGNATURES,
    INITIALIZE_PARAMETERS,
    PIPELINE_METHODS,
    PIPELINE_SIGNATURES,
)
from _engine_testing import config, loss_of, make_dataset, make_mlp


def _missing(engine: object, names: tuple[str, ...]) -> list[str]:
    from ds_engine._absent import ABSENT

    return [n for n in names if n not in ABSENT and not hasattr(engine, n)]


def _absent_errors(engine: object) -> dict[str, str]:
    from ds_engine._absent import ABSENT

    errors = {}
    for name in ABSENT:
        with pytest.raises(AttributeError) as info:
            getattr(engine, name)
        errors[name] = str(info.value)
    return errors


def _surface_body(rank: int, world_size: int) -> dict:
    import torch
    from torch import nn

    import ds_engine
    from ds_comm import PipeDataParallelTopology
    from ds_pipe import PipelineModule

    engine, *_ = ds_engine.initialize(model=make_mlp(), config=config())
    pipe_module = PipelineModule(
        [nn.Linear(4, 4)],
        topology=PipeDataParallelTopology(num_pp=1, num_dp=world_size),
        loss_fn=nn.functional.mse_loss,
    )
    pipe, *_ = ds_engine.initialize(model=pipe_module, config=config())
    return {
        "engine_missing": _missing(engine, ENGINE_METHODS + ENGINE_ATTRIBUTES),
        "private_missing": _missing(engine, CLIENT_PRIVATE_METHODS),
        "pipe_missing": _missing(pipe, ENGINE_METHODS + PIPELINE_METHODS + ENGINE_ATTRIBUTES),
        "engine_absent": _absent_errors(engine),
        "pipe_absent": _absent_errors(pipe),
        "pipe_refuses": [
            _refusal(pipe.forward, torch.zeros(1)),
            _refusal(pipe.backward, torch.zeros(())),
            _refusal(pipe.step),
        ],
        "dtype_ids": (pipe.DTYPE_TO_ID[torch.bfloat16], pipe.ID_TO_DTYPE[11]),
        "pipe_rank": (pipe.get_pipeline_parallel_rank(), pipe.is_first_stage()),
    }


def _refusal(fn, *args) -> str:
    with pytest.raises(RuntimeError) as info:
        fn(*args)
    return str(info.value)


@pytest.mark.parametrize("world_size", [1, 2])
def test_every_deepspeed_engine_name_exists_or_says_why_not(world_size: int) -> None:
    from ds_engine._absent import ABSENT

    # Every absent name really is DeepSpeed's (no stale rows).
    assert set(ABSENT) <= set(ENGINE_METHODS)
    for got in run_on_ranks(_surface_body, world_size, timeout=300):
        assert got["engine_missing"] == [] and got["private_missing"] == []
        assert got["pipe_missing"] == []
        for errors, owner in (
            (got["engine_absent"], "DeepSpeedEngine"),
            (got["pipe_absent"], "PipelineEngine"),
        ):
            for name, message in errors.items():
                assert message.startswith(f"{owner}.{name} is deliberately not provided by ds: ")
                assert ABSENT[name] in message
        assert all("Only train_batch() is accessible" in m for m in got["pipe_refuses"])
        assert got["dtype_ids"][0] == 5 and str(got["dtype_ids"][1]) == "torch.bool"
        assert got["pipe_rank"] == (0, True)


def test_the_accessor_table_resolves_on_a_default_config() -> None:
    from ds_engine import DeepSpeedConfig
    from ds_engine._accessors import accessor_table, read_path

    cfg = DeepSpeedConfig.from_dict({"train_batch_size": 8}, dp_world_size=2)
    table = accessor_table()
    assert len(table) >= 37
    unresolved = []
    for name, path in table.items():
        try:
            read_path(cfg, path)
        except (AttributeError, KeyError):
            unresolved.append(name)
    assert unresolved == []


def test_accessors_are_generated_not_written() -> None:
    """Each table row is one generated method reading its path (see [Note: one mechanism for the
    accessors]); none of them is a hand-written function in the engine's source."""
    import ds_engine._engine_surface as surface
    from ds_engine import DeepSpeedEngine
    from ds_engine._accessors import accessor_table
    from ds_engine._pipe import PipelineDeepSpeedEngine

    for name, path in accessor_table().items():
        for cls in (DeepSpeedEngine, PipelineDeepSpeedEngine):
            method = getattr(cls, name)
            if name in vars(surface.EngineSurface):
                continue  # a derived accessor (computes its value)
            assert method.__doc__ == f"DeepSpeed's ``{name}()``: the config's ``{path}``."


def _accessors_body(rank: int, world_size: int) -> dict:
    import ds_engine

    cfg = config(
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=3,
        gradient_clipping=0.5,
        steps_per_print=7,
        fp16={"enabled": True, "loss_scale": 0, "initial_scale_power": 10},
        zero_optimization={
            "stage": 2,
            "reduce_bucket_size": 1234,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    )
    engine, *_ = ds_engine.initialize(model=make_mlp(), config=cfg)
    return {
        "plain": (
            engine.gradient_clipping(),
            engine.steps_per_print(),
            engine.zero_reduce_bucket_size(),
            engine.zero_gather_16bit_weights_on_model_save(),
            engine.fp16_enabled(),
            engine.bfloat16_enabled(),
            engine.memory_breakdown(),
        ),
        "derived": (
            engine.zero_optimization(),
            engine.zero_optimization_partition_gradients(),
            engine.zero_optimization_partition_weights(),
            engine.dynamic_loss_scale(),
            engine.initial_dynamic_scale(),
            engine.postscale_gradients(),
            engine.zero_cpu_offload(),
            str(engine.communication_data_type),
        ),
        "names": (
            engine.optimizer_name(),
            engine.optimizer_params(),
            engine.scheduler_name(),
            engine.scheduler_params(),
        ),
        "batch": engine.get_batch_info(),
        "config_get": engine.config.get("zero_optimization", {}).get("stage"),
        "config_type": type(engine.config).__name__,
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_accessors_read_the_config(world_size: int) -> None:
    for got in run_on_ranks(_accessors_body, world_size, timeout=300):
        assert got["plain"] == (0.5, 7, 1234, True, True, False, False)
        assert got["derived"] == (True, True, False, True, 1024.0, True, False, "torch.float16")
        assert got["names"] == ("Adam", {"lr": 1e-2, "weight_decay": 0.0}, None, None)
        assert got["batch"] == (2 * 3 * world_size, 2, 3)
        assert got["config_get"] == 2 and got["config_type"] == "dict"


def _parameters(cls: type, name: str) -> tuple[str, ...] | None:
    """The parameter names after ``self`` of ``cls.name`` (None: not a plain function, or one
    taking ``*args``/``**kwargs``, which accepts DeepSpeed's)."""
    attr = inspect.getattr_static(cls, name, None)
    if isinstance(attr, staticmethod):
        attr = attr.__func__
    if not inspect.isfunction(attr):
        return None
    params = list(inspect.signature(attr).parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return None
    return tuple(p.name for p in params if p.name != "self")


def test_methods_take_deepspeeds_parameters() -> None:
    from ds_engine import DeepSpeedEngine
    from ds_engine._pipe import PipelineDeepSpeedEngine

    pipe_reference = {**ENGINE_SIGNATURES, **PIPELINE_SIGNATURES}
    for cls, reference in (
        (DeepSpeedEngine, ENGINE_SIGNATURES),
        (PipelineDeepSpeedEngine, pipe_reference),
    ):
        different = {}
        for name, expected in reference.items():
            ours = _parameters(cls, name)
            if ours is not None and ours != expected:
                different[name] = (ours, expected)
        assert different == {}, cls.__name__


def test_initialize_signature_is_deepspeeds() -> None:
    import ds_engine

    assert tuple(inspect.signature(ds_engine.initialize).parameters) == INITIALIZE_PARAMETERS


def _legacy_config_body(rank: int, world_size: int, path: str) -> dict:
    import ds_engine

    parser = ds_engine.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepscale", "--deepscale_config", path])
    engine, *_ = ds_engine.initialize(args=args, model=make_mlp())
    by_params, *_ = ds_engine.initialize(model=make_mlp(), config_params=config(steps_per_print=3))
    both = argparse.Namespace(deepscale_config=path, deepspeed_config=path)
    with pytest.raises(ds_engine.ConfigError, match="deepscale_config is the legacy name"):
        ds_engine.initialize(args=both, model=make_mlp())
    with pytest.raises(ValueError, match=r"mesh_param=\(2, 1\)"):  # 2 x 1 ranks, world of 1
        ds_engine.initialize(model=make_mlp(), config=config(), mesh_param=(2, 1))
    return {
        "deepscale": engine.steps_per_print(),
        "config_params": by_params.steps_per_print(),
    }


def test_initialize_takes_deepscale_config_and_config_params(tmp_path: Path) -> None:
    import json

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config(steps_per_print=5)))
    (got,) = run_on_ranks(_legacy_config_body, 1, path=str(path), timeout=300)
    assert got == {"deepscale": 5, "config_params": 3}


def _monitor_body(rank: int, world_size: int, path: str) -> dict:
    import csv

    import ds_engine
    from ds_engine._monitor import CsvSink, Monitor

    engine, *_ = ds_engine.initialize(model=make_mlp(), config=config())
    engine.monitor.write_events([("Train/x", 1.0, 1)])  # disabled: writes nowhere
    sink = CsvSink(path, "job") if rank == 0 else None
    monitor = Monitor([sink] if sink else [], rank=rank)
    monitor.write_events([("Train/Samples/loss", 0.5, 8), ("Train/Samples/loss", 0.25, 16)])
    rows = []
    if rank == 0:
        with open(Path(path) / "job" / "Train_Samples_loss.csv") as handle:
            rows = list(csv.reader(handle))
    return {"enabled": engine.monitor.enabled, "rows": rows, "files": sorted(Path(path).rglob("*"))}


def test_monitor_is_disabled_by_default_and_writes_deepspeeds_csv(tmp_path: Path) -> None:
    got = run_on_ranks(_monitor_body, 2, path=str(tmp_path), timeout=300)
    assert got[0]["enabled"] is False
    assert got[0]["rows"] == [["step", "loss"], ["8", "0.5"], ["16", "0.25"]]
    assert len(got[0]["files"]) == 2  # job/ and its one CSV: nothing from the disabled monitor


def _compile_destroy_body(rank: int, world_size: int) -> dict:
    import torch

    import ds_engine

    engine, *_ = ds_engine.initialize(model=make_mlp(), config=config())
    x = torch.randn(3, 8)
    eager = engine(x).detach()
    engine.compile(backend="eager", compile_kwargs={"dynamic": False})
    compiled_ok = engine.is_compiled and torch.equal(engine(x).detach(), eager)
    with pytest.raises(NotImplementedError, match="DeepCompile schedules"):
        engine.compile(schedule=[(0, [])])
    data = make_dataset(4)
    loss = loss_of(engine, [t[:4] for t in data.tensors])
    returned = engine.backward(loss)
    engine.step()
    engine.zero_grad()
    # None, or (ds-zero's flat gradient buffer, re-aliased) zero
    grads_cleared = all(p.grad is None or not p.grad.any() for p in engine.module.parameters())
    engine.destroy()
    return {
        "compiled": compiled_ok,
        "backward_returns": float(returned) == pytest.approx(float(loss)),
        "grads_cleared": grads_cleared,
        "gc": isinstance(engine.collect_python_gc(), int),
        "map_style": (
            engine.is_map_style_dataset(data),
            engine.is_iterable_style_dataset(data),
        ),
        "timers": engine.get_wall_clock_timers(),
    }


def test_compile_zero_grad_and_destroy() -> None:
    (got,) = run_on_ranks(_compile_destroy_body, 1, timeout=300)
    assert got["compiled"] and got["backward_returns"] and got["grads_cleared"] and got["gc"]
    assert got["map_style"] == (True, False)
    assert got["timers"] == {}  # wall_clock_breakdown is off


def _timers_body(rank: int, world_size: int) -> list[str]:
    import ds_engine

    engine, *_ = ds_engine.initialize(model=make_mlp(), config=config(wall_clock_breakdown=True))
    data = make_dataset(4)
    engine.backward(loss_of(engine, list(data.tensors)))
    engine.step()
    return sorted(engine.get_wall_clock_timers())


def test_wall_clock_timers_use_deepspeeds_names() -> None:
    names = ["fwd", "bwd", "bwd_inner", "bwd_allreduce", "step"]
    names += [f"{n}_microstep" for n in names]
    names += ["optimizer_gradients", "optimizer_step", "optimizer_allgather"]
    assert run_on_ranks(_timers_body, 1, timeout=300) == [sorted(names)]
