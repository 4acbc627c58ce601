"""The monitors through the real libraries: an engine on 2 gloo ranks with ``tensorboard``,
``csv_monitor`` and ``wandb`` (offline) enabled writes DeepSpeed's events from rank 0 only; the
TensorBoard event files are read back with TensorBoard's own reader, the CSV files as text and
the W&B run's history from the run itself. Plus the config sections, the missing-package error
and DeepSpeed's ``deepspeed.monitor`` classes."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _engine_testing import config, loss_of, make_dataset, make_mlp

from ds_engine import ConfigError, DeepSpeedConfig

STEPS = 4
MICRO = 4  # train_micro_batch_size_per_gpu in _engine_testing.config()


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a TensorBoard run folder, read with TensorBoard's event reader."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(log_dir))
    reader.Reload()
    return {
        tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]
    }


def _monitored_body(rank: int, world_size: int, *, root: str) -> dict:
    import os

    import ds_engine

    os.environ.update(WANDB_MODE="offline", WANDB_DIR=root, WANDB_SILENT="true")
    monitors = {
        "tensorboard": {"enabled": True, "output_path": f"{root}/tb", "job_name": "run"},
        "csv_monitor": {"enabled": True, "output_path": f"{root}/csv", "job_name": "run"},
        "wandb": {"enabled": True, "project": "ds-test", "group": "g"},
    }
    engine, *_ = ds_engine.initialize(model=make_mlp(), config=config(**monitors))
    data = make_dataset(MICRO * world_size * STEPS)
    losses = []
    for step in range(STEPS):
        start = (step * world_size + rank) * MICRO
        loss = loss_of(engine, [t[start : start + MICRO] for t in data.tensors])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    # a user event; W&B steps only grow, so it goes after the last training step
    engine.monitor.write_events([("Train/custom", 7.0, 100)])
    wandb_last = None
    if rank == 0:  # commit the pending row (as finishing would); the summary holds the last values
        sink = next(s for s in engine.monitor.sinks if type(s).__name__ == "WandbSink")
        sink.log({}, commit=True)
        wandb_last = dict(sink.run.summary)
    enabled = engine.monitor.enabled
    engine.destroy()  # closes the monitors: the W&B run finishes (the worker outlives the test)
    return {"losses": losses, "enabled": enabled, "wandb": wandb_last}


def test_engine_writes_deepspeeds_events_to_tensorboard_csv_and_wandb(tmp_path: Path) -> None:
    results = run_on_ranks(_monitored_body, 2, root=str(tmp_path), timeout=300)
    assert [r["enabled"] for r in results] == [True, True]
    samples = [MICRO * 2 * (step + 1) for step in range(STEPS)]  # global samples per step
    # DeepSpeed writes rank 0's loss, keyed by the global samples seen so far.
    rank0_losses = results[0]["losses"]

    scalars = _scalars(tmp_path / "tb" / "run")
    assert [s for s, _ in scalars["Train/Samples/train_loss"]] == samples
    got = [v for _, v in scalars["Train/Samples/train_loss"]]
    assert got == pytest.approx(rank0_losses, rel=1e-6)
    assert [v for _, v in scalars["Train/Samples/lr"]] == pytest.approx([1e-2] * STEPS)
    assert scalars["Train/custom"] == [(100, 7.0)]

    with open(tmp_path / "csv" / "run" / "Train_Samples_train_loss.csv") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == ["step", "train_loss"]
    assert [int(r[0]) for r in rows[1:]] == samples
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(rank0_losses, rel=1e-6)

    summary = results[0]["wandb"]
    assert summary["Train/Samples/train_loss"] == pytest.approx(rank0_losses[-1], rel=1e-6)
    assert summary["Train/custom"] == 7.0
    assert results[1]["wandb"] is None  # rank 1 never starts a run
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))  # one offline run


def test_monitor_sections_are_typed_with_deepspeeds_defaults() -> None:
    cfg = DeepSpeedConfig.from_dict(
        config(tensorboard={"enabled": True}, comet={"samples_log_interval": 5})
    )
    assert cfg.tensorboard.output_path == "" and cfg.tensorboard.job_name == "DeepSpeedJobName"
    assert cfg.wandb.project == "deepspeed" and cfg.comet.samples_log_interval == 5
    assert cfg.monitor_config.enabled
    with pytest.raises(ConfigError, match=r"wandb\.projet is not a known key.*'project'"):
        DeepSpeedConfig.from_dict(config(wandb={"projet": "x"}))
    with pytest.raises(ConfigError, match=r"csv_monitor\.enabled = 'yes': expected true or false"):
        DeepSpeedConfig.from_dict(config(csv_monitor={"enabled": "yes"}))
    with pytest.raises(ConfigError, match=r"comet\.samples_log_interval = 0"):
        DeepSpeedConfig.from_dict(config(comet={"samples_log_interval": 0}))


def test_a_missing_backend_package_names_the_section_and_the_pip_command(tmp_path: Path) -> None:
    from ds_engine._monitor import build_monitor

    if importlib.util.find_spec("comet_ml") is not None:
        pytest.skip("comet_ml is installed here")
    tensorboard = {"enabled": True, "output_path": str(tmp_path), "job_name": "tb"}
    cfg = DeepSpeedConfig.from_dict(config(tensorboard=tensorboard, comet={"enabled": True}))
    for rank in (0, 1):  # every rank refuses, so none waits for the others
        with pytest.raises(ConfigError, match=r"comet\.enabled = true needs the 'comet_ml'.*pip"):
            build_monitor(cfg, rank=rank)
    assert not (tmp_path / "tb").exists()  # refused before any sink was made


def test_deepspeeds_monitor_classes_write_through_the_same_sinks(tmp_path: Path) -> None:
    from ds_engine.monitor.config import TensorBoardConfig, get_monitor_config
    from ds_engine.monitor.csv_monitor import csvMonitor
    from ds_engine.monitor.monitor import MonitorMaster
    from ds_engine.monitor.tensorboard import TensorBoardMonitor

    tb = TensorBoardMonitor(
        TensorBoardConfig(enabled=True, output_path=str(tmp_path), job_name="a")
    )
    tb.write_events([("Train/loss", 2.5, 10)])
    tb.flush()
    assert _scalars(tmp_path / "a")["Train/loss"] == [(10, 2.5)]

    master = MonitorMaster(
        get_monitor_config({"csv_monitor": {"enabled": True, "output_path": str(tmp_path)}})
    )
    assert master.enabled and isinstance(master.csv_monitor, csvMonitor)
    assert not master.tb_monitor.enabled and master.tb_monitor.summary_writer is None
    master.write_events([("Train/acc", 0.75, 4)])
    text = (tmp_path / "DeepSpeedJobName" / "Train_acc.csv").read_text().split()
    assert text == ["step,acc", "4,0.75"]
