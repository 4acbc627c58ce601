"""Autotuning: the CPU peak-memory tracker, the config section, the memory prediction, the
engine's experiment mode on real gloo ranks and (slow) ``ds-autotune`` on the example GPT with
its predictions within 10% of the measured peaks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_comm import ConfigError
from ds_engine.autotuning import AutotuningConfig, LiveTensorBytes
from ds_engine.autotuning._experiments import candidate_config, with_config
from ds_engine.autotuning._predict import Candidate, ModelInfo, predict_peak
from ds_engine.autotuning._tuner import Row, format_table
from ds_testing import run_on_ranks
from ds_zero import estimate_model_states

ROOT = Path(__file__).resolve().parents[3]
MIB = 2**20


# --- the tracker -----------------------------------------------------------------------------


def test_live_bytes_counts_storages_once_and_forgets_freed_ones():
    with LiveTensorBytes() as live:
        base = live.current
        a = torch.empty(MIB, dtype=torch.uint8)
        view = a[10:]  # a view: the same storage, not counted again
        assert live.current - base == MIB
        b = torch.ones(256, 1024)  # 1 MiB of fp32
        assert live.current - base == 2 * MIB
        del a, b
        assert live.current - base == MIB  # the view keeps a's storage alive
        del view
        assert live.current == base
    assert live.peak - base == 2 * MIB


def test_live_bytes_sees_in_place_storage_resizes_at_the_next_allocation():
    with LiveTensorBytes() as live:
        base = live.current
        a = torch.empty(MIB, dtype=torch.uint8)
        a.untyped_storage().resize_(0)  # what ZeRO-3 does to a released parameter
        b = torch.empty(16, dtype=torch.uint8)
        assert live.current - base == 16
        del a, b


def test_live_bytes_counts_tensors_alive_before_it_started_and_autograd():
    keep = torch.empty(MIB, dtype=torch.uint8)
    w = torch.randn(512, 512, requires_grad=True)
    with LiveTensorBytes() as live:
        assert live.current >= keep.nbytes + w.nbytes
        before = live.current
        y = (w * 2).sum()
        y.backward()  # the gradient is made on the autograd engine, and counted
        assert w.grad is not None
        assert live.current - before >= w.grad.nbytes
    del keep


# --- the config section ----------------------------------------------------------------------


def test_config_has_deepspeeds_defaults_and_refuses_bad_values():
    c = AutotuningConfig.from_section(None)
    assert (c.metric, c.start_profile_step, c.end_profile_step, c.tuner_type) == (
        "throughput",
        3,
        5,
        "gridsearch",
    )
    assert c.results_dir == "autotuning_results" and c.exps_dir == "autotuning_exps"
    with pytest.raises(ConfigError, match=r"autotuning\.metric = 'speed'"):
        AutotuningConfig.from_section({"metric": "speed"})
    with pytest.raises(ConfigError, match="model_based"):
        AutotuningConfig.from_section({"tuner_type": "model_based"})
    with pytest.raises(ConfigError, match="end_profile_step = 2 is before"):
        AutotuningConfig.from_section({"start_profile_step": 3, "end_profile_step": 2})
    with pytest.raises(ConfigError, match=r"start_step is DeepSpeed's old name"):
        AutotuningConfig.from_section({"start_step": 3})


def test_engine_config_accepts_an_enabled_autotuning_section():
    import ds_engine

    cfg = ds_engine.DeepSpeedConfig.from_dict(
        {"train_batch_size": 4, "autotuning": {"enabled": True, "metric": "latency"}}
    )
    assert cfg.unimplemented.autotuning.enabled is True
    with pytest.raises(ConfigError, match="metrc"):
        ds_engine.DeepSpeedConfig.from_dict({"train_batch_size": 4, "autotuning": {"metrc": 1}})


# --- the prediction --------------------------------------------------------------------------


def _info(**kw) -> ModelInfo:
    values = dict(
        num_params=10**6,
        largest_layer_params=10**5,
        param_bytes=4,
        optimizer_state_bytes=8,
        activation_bytes=4 * MIB,
        micro_batch=1,
        host_is_separate=True,
    )
    values.update(kw)
    return ModelInfo(**values)


def test_prediction_adds_the_estimators_states_and_scales_activations_linearly():
    info = _info()
    for stage in (0, 1, 2):
        pred = predict_peak(Candidate(stage, 1), info, world_size=2)
        states = estimate_model_states(10**6, stage=stage, world_size=2, param_bytes=4)
        assert pred.model_states == states.model_states
    small, big = (predict_peak(Candidate(2, mb), info, world_size=2) for mb in (4, 8))
    assert big.activations == 2 * small.activations == 32 * MIB
    # stage 3 shards what stage 2 keeps whole, offload moves the optimizer off the device
    z2, z3 = (predict_peak(Candidate(s, 1), info, world_size=4).model_states for s in (2, 3))
    assert z3 < z2
    offloaded = predict_peak(Candidate(2, 1, "cpu"), info, world_size=2)
    assert offloaded.model_states < predict_peak(Candidate(2, 1), info, world_size=2).model_states


def test_table_shows_prediction_measured_error_fits_and_speed():
    info = _info()
    pred = predict_peak(Candidate(1, 2), info, world_size=2)
    measured = {"peak_memory_bytes": pred.total * 100 // 105, "throughput": 12.5}
    rows = [
        Row(Candidate(1, 2), pred, True, metrics=measured),
        Row(Candidate(0, 64), predict_peak(Candidate(0, 64), info, world_size=2), False),
    ]
    table = format_table(rows, 300 * MIB)
    assert "| z1, 2, none |" in table and "| +5.0 | yes | 12.5 |" in table
    assert "| z0, 64, none |" in table and "| - | no | - |" in table


def test_experiment_config_and_arguments(tmp_path):
    tuning = AutotuningConfig.from_section(
        {"arg_mappings": {"train_micro_batch_size_per_gpu": "--batch"}}
    )
    user = {
        "train_batch_size": 32,
        "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}},
    }
    config = candidate_config(user, Candidate(2, 8), tuning, str(tmp_path))
    assert "train_batch_size" not in config and config["train_micro_batch_size_per_gpu"] == 8
    assert config["zero_optimization"] == {"stage": 2}
    assert config["autotuning"]["enabled"] is True
    assert config["autotuning"]["metric_path"] == str(tmp_path / "metrics.json")
    args = with_config(
        ["--deepspeed_config", "a.json", "--batch", "1"], "b.json", config, tuning.arg_mappings
    )
    assert args == ["--deepspeed_config", "b.json", "--batch", "8"]


# --- the engine's experiment mode, on real ranks ----------------------------------------------


def _experiment_body(rank: int, world_size: int, *, stage: int, metric_path: str) -> int:
    import ds_engine as deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 1))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
        "autotuning": {
            "enabled": True,
            "metric_path": metric_path,
            "start_profile_step": 3,
            "end_profile_step": 3,
        },
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    x, y = torch.randn(8, 64), torch.randn(8, 1)
    with pytest.raises(SystemExit) as exit_info:  # DeepSpeed's engine exits after the profile
        for _ in range(10):
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
    assert exit_info.value.code == 0
    assert engine.global_steps == 3
    return engine.memory_usage().model_states


@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), 2])
def test_engine_experiment_writes_metrics_and_exits_after_end_profile_step(tmp_path, stage):
    path = str(tmp_path / "metrics.json")
    states = run_on_ranks(_experiment_body, 2, stage=stage, metric_path=path)
    metrics = json.loads(Path(path).read_text())
    assert metrics["train_batch_size"] == 16
    assert metrics["throughput"] == pytest.approx(16 / metrics["latency"])
    assert metrics["peak_memory_counts"] == "live tensor bytes"
    # the peak holds at least the model states, and the forward kept the activations
    assert metrics["peak_memory_bytes"] >= max(states)
    assert metrics["activation_peak_bytes"] >= metrics["activation_bytes"] > 8 * 256 * 4
    assert metrics["model_info"]["num_params"] == 64 * 256 + 256 + 256 + 1


# --- ds-autotune on the example GPT (slow: a profile run and a timed run per candidate) -------

GPT_ARGS = ["--vocab", "1024", "--dim", "256", "--layers", "4", "--seq", "32"]


@pytest.mark.slow
def test_ds_autotune_predictions_within_10_percent_on_the_example_gpt(tmp_path):
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": "all"},
        "steps_per_print": 100,
        "autotuning": {
            "enabled": True,
            "results_dir": str(tmp_path / "results"),
            "exps_dir": str(tmp_path / "exps"),
            "start_profile_step": 3,
            "end_profile_step": 3,
        },
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    cmd = [
        sys.executable,
        "-m",
        "ds_engine.autotuning",  # ds-launch --autotuning takes only the launcher's flags
        "--autotuning",
        "tune",
        "--num_gpus",
        "2",
        "--stages",
        "0,2,3",
        "--micro_batch_sizes",
        "4",
        "--memory_per_rank",
        "0.5",
        str(ROOT / "tools/examples/gpt/train.py"),
        "--deepspeed_config",
        str(path),
        *GPT_ARGS,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3000)
    assert out.returncode == 0, out.stdout + out.stderr
    print(out.stdout)
    results = json.loads((tmp_path / "results" / "results.json").read_text())
    timed = [r for r in results["rows"] if r["measured_bytes"]]
    assert len(timed) == 3
    for row in timed:
        error = abs(row["predicted_bytes"] - row["measured_bytes"]) / row["measured_bytes"]
        assert error < 0.10, (row["name"], error)
    optimal = json.loads((tmp_path / "results" / "ds_config_optimal.json").read_text())
    assert "autotuning" not in optimal and results["best"] is not None
    assert (tmp_path / "results" / "cmd_optimal.txt").read_text().strip()


def test_ds_launch_autotuning_hands_the_command_line_to_ds_autotune(capfd):
    # ds-autotune runs in its own process (ds-launch imports no torch) and names what is missing
    from ds_launch.cli import main

    assert main(["--autotuning", "tune", "--num_gpus", "2", "t.py", "--lr", "1"]) == 2
    err = capfd.readouterr().err
    assert "ds-autotune: error: the user script's arguments name no DeepSpeed config" in err
