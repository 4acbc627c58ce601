"""The ``autotuning`` config section, DeepSpeed's keys and defaults, validated.

The engine reads it when ``enabled`` is true (an experiment: profile, write the metrics, exit);
``ds-autotune`` reads it from the user's config to bound the search.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ds_comm import ConfigError

__all__ = ["METRICS", "TUNER_TYPES", "AutotuningConfig"]

METRICS = ("throughput", "latency", "flops")
TUNER_TYPES = ("gridsearch", "random")


@dataclass(frozen=True, kw_only=True)
class AutotuningConfig:
    """DeepSpeed's ``autotuning`` section (``deepspeed/autotuning/config.py``'s keys).

    Attributes:
        enabled: the engine profiles ``start_profile_step..end_profile_step``, writes the
            metrics to ``metric_path`` and exits (how the tuner's experiments report).
        results_dir: where ``ds-autotune`` writes the table and ``ds_config_optimal.json``.
        exps_dir: where it writes each experiment's config, command and output.
        overwrite: rerun experiments whose results exist (false: reuse them).
        metric: ``throughput`` (samples/s), ``latency`` (s/step) or ``flops`` (per rank).
        start_profile_step: first optimizer step timed (>= 3: the steps before it measure
            memory, the second of them in the steady state).
        end_profile_step: last step timed; the run exits after it.
        fast: time only the fastest kind of candidate (no offload when that fits).
        max_train_batch_size: cap on micro-batch x accumulation x data-parallel ranks.
        min_train_batch_size: floor on the same.
        max_train_micro_batch_size_per_gpu, min_train_micro_batch_size_per_gpu: the range.
        num_tuning_micro_batch_sizes: micro-batch sizes timed per stage.
        mp_size: model-parallel size (data-parallel ranks = ranks / mp_size).
        tuner_type: ``gridsearch`` (in order) or ``random`` order of the timed candidates.
        tuner_early_stopping: stop after this many timed candidates without improvement.
        tuner_num_trials: time at most this many candidates.
        arg_mappings: config key -> the user script's flag that must carry the same value.
        metric_path, model_info_path: where an experiment writes (default: the cwd).
        model_info: DeepSpeed's model-info profile settings (``profile: true`` writes it).
    """

    enabled: bool = False
    results_dir: str = "autotuning_results"
    exps_dir: str = "autotuning_exps"
    overwrite: bool = True
    metric: str = "throughput"
    start_profile_step: int = 3
    end_profile_step: int = 5
    fast: bool = True
    max_train_batch_size: int | None = None
    min_train_batch_size: int = 1
    max_train_micro_batch_size_per_gpu: int = 1024
    min_train_micro_batch_size_per_gpu: int = 1
    num_tuning_micro_batch_sizes: int = 3
    mp_size: int = 1
    tuner_type: str = "gridsearch"
    tuner_early_stopping: int = 5
    tuner_num_trials: int = 50
    arg_mappings: dict[str, str] = field(default_factory=dict)
    metric_path: str | None = None
    model_info_path: str | None = None
    model_info: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _choice("metric", self.metric, METRICS)
        if self.tuner_type == "model_based":
            raise ConfigError(
                "autotuning.tuner_type = 'model_based' (DeepSpeed's XGBoost cost model) is not "
                "implemented in ds: ds predicts memory before timing anything, so few candidates "
                "are left to time; use 'gridsearch' or 'random'"
            )
        _choice("tuner_type", self.tuner_type, TUNER_TYPES)
        for key in (
            "start_profile_step",
            "end_profile_step",
            "num_tuning_micro_batch_sizes",
            "mp_size",
            "tuner_early_stopping",
            "tuner_num_trials",
            "min_train_batch_size",
            "max_train_micro_batch_size_per_gpu",
            "min_train_micro_batch_size_per_gpu",
        ):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"autotuning.{key} = {value!r}: expected an integer >= 1")
        if self.start_profile_step < 3:
            raise ConfigError(
                f"autotuning.start_profile_step = {self.start_profile_step}: expected >= 3 (the "
                "steps before it measure memory: the first allocates the optimizer's state, the "
                "second is the steady state; the steps from it on are timed)"
            )
        if self.end_profile_step < self.start_profile_step:
            raise ConfigError(
                f"autotuning.end_profile_step = {self.end_profile_step} is before "
                f"start_profile_step = {self.start_profile_step}; set it >= start_profile_step"
            )
        if self.min_train_micro_batch_size_per_gpu > self.max_train_micro_batch_size_per_gpu:
            raise ConfigError(
                "autotuning.min_train_micro_batch_size_per_gpu = "
                f"{self.min_train_micro_batch_size_per_gpu} exceeds "
                f"max_train_micro_batch_size_per_gpu = {self.max_train_micro_batch_size_per_gpu}"
            )
        if not self.results_dir or not self.exps_dir:
            raise ConfigError("autotuning.results_dir and exps_dir must not be empty")

    @classmethod
    def from_section(cls, section: Mapping[str, Any] | None) -> AutotuningConfig:
        """From the config's ``autotuning`` section (``None``/missing: the defaults).

        DeepSpeed's legacy ``start_step``/``end_step`` are its profile steps' old names; a
        value there is refused with the new name.
        """
        to_dict = getattr(section, "to_dict", None)
        raw: Any = to_dict() if callable(to_dict) else (section or {})
        values: dict[str, Any] = {str(k): v for k, v in dict(raw).items()}
        for old, new in (("start_step", "start_profile_step"), ("end_step", "end_profile_step")):
            if values.pop(old, None) is not None:
                raise ConfigError(f"autotuning.{old} is DeepSpeed's old name; use {new}")
        if values.get("max_train_batch_size") is not None:
            value = values["max_train_batch_size"]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"autotuning.max_train_batch_size = {value!r}: expected an integer >= 1"
                )
        values["arg_mappings"] = dict(values.get("arg_mappings") or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"autotuning: unknown keys {unknown}; known: {sorted(known)}")
        return cls(**values)

    @property
    def metric_file(self) -> str:
        """``metric_path``, or DeepSpeed's default ``autotuning_metric.json`` in the cwd."""
        return self.metric_path or os.path.join(os.getcwd(), "autotuning_metric.json")

    @property
    def model_info_file(self) -> str:
        """``model_info_path``, or DeepSpeed's default ``autotuning_model_info.json``."""
        return self.model_info_path or os.path.join(os.getcwd(), "autotuning_model_info.json")


def _choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"autotuning.{key} = {value!r}: expected one of {list(choices)}")
