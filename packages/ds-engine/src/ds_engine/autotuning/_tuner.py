"""The search: one profile run, a prediction for every candidate, timed runs of those that fit.

[Note: predict, then time]
DeepSpeed's autotuner finds each stage's largest micro-batch by running it until one fails with
out-of-memory, then times a list of micro-batches per stage. ds runs the user's script once
(the profile run: stage 0 at the smallest micro-batch) to learn the parameter count, dtypes and
the activation bytes of one micro-batch, predicts every candidate's peak per rank with the ZeRO
estimators (see ``_predict.py``), and times only those predicted to fit the memory budget:
no run is spent discovering an out-of-memory. The table shows each prediction next to the peak
the timed run measured, so a wrong prediction is visible.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ds_engine.autotuning._config import AutotuningConfig
from ds_engine.autotuning._experiments import candidate_config, run_experiment
from ds_engine.autotuning._predict import (
    Candidate,
    ModelInfo,
    Prediction,
    ZeroKnobs,
    predict_peak,
)

__all__ = ["Row", "TuningJob", "tune"]


@dataclass(frozen=True)
class TuningJob:
    """What ``ds-autotune`` was asked: the launch, the user's config and the search bounds.

    Attributes:
        launcher_args: ds-launch flags for every experiment (ranks, hosts, port).
        user_script, user_args: the training script and its arguments.
        user_config: the user's DeepSpeed config.
        tuning: its ``autotuning`` section.
        world_size: data-parallel ranks of an experiment.
        memory_per_rank: the budget in bytes a candidate must be predicted to fit.
        stages: ZeRO stages to consider.
        micro_batch_sizes: explicit micro-batches to consider (None: derived from the budget).
    """

    launcher_args: tuple[str, ...]
    user_script: str
    user_args: tuple[str, ...]
    user_config: Mapping[str, Any]
    tuning: AutotuningConfig
    world_size: int
    memory_per_rank: int
    stages: tuple[int, ...] = (0, 1, 2, 3)
    micro_batch_sizes: tuple[int, ...] | None = None


@dataclass
class Row:
    """One candidate's line of the table."""

    candidate: Candidate
    prediction: Prediction
    fits: bool
    metrics: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def measured(self) -> int | None:
        """The measured peak bytes per rank (max over ranks), once timed."""
        return None if self.metrics is None else int(self.metrics["peak_memory_bytes"])

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured."""
        m = self.measured
        return None if not m else (self.prediction.total - m) / m


def tune(job: TuningJob) -> tuple[list[Row], Row | None]:
    """Profile, predict, time what fits; writes ``results_dir`` and returns the rows and the
    best (None when nothing ran)."""
    tuning = job.tuning
    if tuning.overwrite:
        shutil.rmtree(tuning.results_dir, ignore_errors=True)
    os.makedirs(tuning.results_dir, exist_ok=True)
    info = _profile(job)
    rows = _predict_all(job, info)
    best: Row | None = None
    since_best = 0
    for row in _timing_order(job, rows):
        exp_dir = os.path.join(tuning.exps_dir, row.candidate.name)
        config = candidate_config(job.user_config, row.candidate, tuning, exp_dir)
        row.metrics = run_experiment(
            row.candidate.name,
            config,
            exp_dir=exp_dir,
            launcher_args=job.launcher_args,
            user_script=job.user_script,
            user_args=job.user_args,
            tuning=tuning,
        )
        if row.metrics is None:
            row.notes.append("failed")
            continue
        if best is None or _better(row, best, tuning.metric):
            best, since_best = row, 0
        else:
            since_best += 1
            if since_best >= tuning.tuner_early_stopping:
                break
    _write_results(job, rows, best)
    return rows, best


def _profile(job: TuningJob) -> ModelInfo:
    tuning = job.tuning
    mb = min(job.micro_batch_sizes or (tuning.min_train_micro_batch_size_per_gpu,))
    exp_dir = os.path.join(tuning.exps_dir, "profile")
    config = candidate_config(job.user_config, Candidate(0, mb), tuning, exp_dir)
    config["autotuning"].update(start_profile_step=3, end_profile_step=3)
    metrics = run_experiment(
        "profile",
        config,
        exp_dir=exp_dir,
        launcher_args=job.launcher_args,
        user_script=job.user_script,
        user_args=job.user_args,
        tuning=tuning,
    )
    if metrics is None:
        raise RuntimeError(
            f"the profile run (stage 0, micro-batch {mb}) failed; see {exp_dir}/output.log"
        )
    model = metrics["model_info"]
    state = metrics["memory_breakdown"]["optimizer_state"]
    return ModelInfo(
        num_params=model["num_params"],
        largest_layer_params=model["largest_layer_params"],
        param_bytes=model["param_bytes"],
        optimizer_state_bytes=_state_bytes_per_param(state, model),
        activation_bytes=metrics["activation_peak_bytes"],
        micro_batch=mb,
        resident_bytes=metrics["other_resident_bytes"],
        host_is_separate=metrics["peak_memory_counts"] == "allocator",
    )


def _state_bytes_per_param(state: int, model: Mapping[str, Any]) -> int:
    """Optimizer state per parameter from stage 0's breakdown (which adds an fp32 master
    copy when the parameters are 16-bit)."""
    per_param = round(state / max(model["trainable_num_params"], 1))
    return per_param - 4 if model["param_bytes"] < 4 else per_param


def _predict_all(job: TuningJob, info: ModelInfo) -> list[Row]:
    tuning = job.tuning
    zero = dict(job.user_config.get("zero_optimization") or {})
    knobs = ZeroKnobs(
        reduce_bucket_size=int(zero.get("reduce_bucket_size", 500_000_000)),
        stage3_max_live_parameters=int(zero.get("stage3_max_live_parameters", 1_000_000_000)),
    )
    gas = int(job.user_config.get("gradient_accumulation_steps", 1))
    dp = max(job.world_size // tuning.mp_size, 1)
    rows: list[Row] = []
    for stage in job.stages:
        # Offload moves state to host memory: no saving where host memory is the device.
        offloads = ("none", "cpu") if stage and info.host_is_separate else ("none",)
        for offload in offloads:
            for mb in _micro_batches(job, info, stage, offload, dp, gas, knobs):
                candidate = Candidate(stage, mb, offload)
                pred = predict_peak(candidate, info, world_size=dp, zero=knobs)
                rows.append(Row(candidate, pred, pred.total <= job.memory_per_rank))
    return rows


def _micro_batches(
    job: TuningJob, info: ModelInfo, stage: int, offload: str, dp: int, gas: int, knobs: ZeroKnobs
) -> list[int]:
    """The micro-batches to consider: the job's list, or ``num_tuning_micro_batch_sizes``
    values up to the largest one predicted to fit (never above the configured bounds)."""
    tuning = job.tuning
    low, high = tuning.min_train_micro_batch_size_per_gpu, tuning.max_train_micro_batch_size_per_gpu
    if tuning.max_train_batch_size is not None:
        high = min(high, tuning.max_train_batch_size // (gas * dp))
    if job.micro_batch_sizes is not None:
        return [mb for mb in job.micro_batch_sizes if low <= mb <= high]
    fits = [
        mb
        for mb in range(low, high + 1)
        if predict_peak(Candidate(stage, mb, offload), info, world_size=dp, zero=knobs).total
        <= job.memory_per_rank
    ]
    top = max(fits, default=low)
    count = tuning.num_tuning_micro_batch_sizes
    picks = {max(low, round(top * (i + 1) / count)) for i in range(count)}
    return sorted(mb for mb in picks if mb * gas * dp >= tuning.min_train_batch_size)


def _timing_order(job: TuningJob, rows: list[Row]) -> list[Row]:
    """The fitting candidates in the tuner's order, at most ``tuner_num_trials``; with
    ``fast``, offload candidates only for stages where nothing fits without offload."""
    tuning = job.tuning
    fitting = [r for r in rows if r.fits]
    if tuning.fast:
        plain = {r.candidate.stage for r in fitting if r.candidate.offload == "none"}
        for r in fitting:
            if r.candidate.offload != "none" and r.candidate.stage in plain:
                r.notes.append("not timed (fast: fits without offload)")
        fitting = [
            r for r in fitting if r.candidate.offload == "none" or r.candidate.stage not in plain
        ]
    if tuning.tuner_type == "random":
        random.Random(0).shuffle(fitting)
    for r in fitting[tuning.tuner_num_trials :]:
        r.notes.append("not timed (tuner_num_trials)")
    return fitting[: tuning.tuner_num_trials]


def _better(row: Row, best: Row, metric: str) -> bool:
    assert row.metrics is not None and best.metrics is not None
    if metric == "latency":
        return row.metrics["latency"] < best.metrics["latency"]
    key = "FLOPS_per_gpu" if metric == "flops" else "throughput"
    return row.metrics.get(key, 0.0) > best.metrics.get(key, 0.0)


def format_table(rows: Sequence[Row], memory_per_rank: int) -> str:
    """The Markdown table: candidate | predicted | measured | error | fits | samples/s."""
    lines = [
        f"memory budget per rank: {_mib(memory_per_rank)}",
        "",
        "| candidate (stage, micro-batch, offload) | predicted | measured | error % | fits? "
        "| samples/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r.candidate
        measured = _mib(r.measured) if r.measured is not None else "-"
        error = f"{round(100 * r.error, 1) + 0.0:+.1f}" if r.error is not None else "-"
        speed = f"{r.metrics['throughput']:.1f}" if r.metrics is not None else "-"
        note = f" ({'; '.join(r.notes)})" if r.notes else ""
        lines.append(
            f"| z{c.stage}, {c.micro_batch}, {c.offload} | {_mib(r.prediction.total)} | "
            f"{measured} | {error} | {'yes' if r.fits else 'no'}{note} | {speed} |"
        )
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _write_results(job: TuningJob, rows: list[Row], best: Row | None) -> None:
    tuning = job.tuning
    table = format_table(rows, job.memory_per_rank)
    summary = table
    if best is not None:
        summary += f"\n\nbest ({tuning.metric}): {best.candidate.name}\n"
        exp_dir = os.path.join(tuning.exps_dir, best.candidate.name)
        with open(os.path.join(exp_dir, "ds_config.json")) as f:
            optimal = json.load(f)
        optimal.pop("autotuning", None)
        with open(os.path.join(tuning.results_dir, "ds_config_optimal.json"), "w") as f:
            json.dump(optimal, f, indent=1)
        with open(os.path.join(exp_dir, "cmd.txt")) as f:
            cmd = f.read().split()
        path = os.path.join(tuning.results_dir, "ds_config_optimal.json")
        from ds_engine.autotuning._experiments import config_path_of

        cmd[config_path_of(cmd)] = path
        with open(os.path.join(tuning.results_dir, "cmd_optimal.txt"), "w") as f:
            f.write(" ".join(cmd) + "\n")
    else:
        summary += "\n\nno candidate ran; nothing fits or every run failed\n"
    with open(os.path.join(tuning.results_dir, "summary.txt"), "w") as f:
        f.write(summary)
    records = [
        {
            "name": r.candidate.name,
            "stage": r.candidate.stage,
            "micro_batch": r.candidate.micro_batch,
            "offload": r.candidate.offload,
            "predicted_bytes": r.prediction.total,
            "prediction_terms": vars(r.prediction),
            "measured_bytes": r.measured,
            "fits": r.fits,
            "metrics": r.metrics,
            "notes": r.notes,
        }
        for r in rows
    ]
    with open(os.path.join(tuning.results_dir, "results.json"), "w") as f:
        json.dump({"best": best.candidate.name if best else None, "rows": records}, f, indent=1)
