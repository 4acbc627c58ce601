"""Running one experiment: the user's script on the launcher's ranks with a candidate config.

An experiment is a folder under ``exps_dir`` holding its ``ds_config.json`` (the user's config
with the candidate's stage, micro-batch and offload, and ``autotuning.enabled`` so the engine
measures itself and exits), ``cmd.txt``, ``output.log`` and the ``metrics.json`` the engine
writes.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ds_engine.autotuning._config import AutotuningConfig
from ds_engine.autotuning._predict import Candidate

__all__ = ["candidate_config", "config_path_of", "run_experiment", "with_config"]

_CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed")


def config_path_of(user_args: Sequence[str]) -> int:
    """Index in ``user_args`` of the config path (after ``--deepspeed_config`` or
    ``--deepspeed``); ValueError naming the flags when there is none."""
    for i, word in enumerate(user_args[:-1]):
        if word in _CONFIG_FLAGS and user_args[i + 1].endswith(".json"):
            return i + 1
    raise ValueError(
        "the user script's arguments name no DeepSpeed config: pass --deepspeed_config "
        "<file.json> (or --deepspeed <file.json>) after the script"
    )


def candidate_config(
    user_config: Mapping[str, Any], candidate: Candidate, tuning: AutotuningConfig, exp_dir: str
) -> dict[str, Any]:
    """The user's config with ``candidate``'s settings and the experiment's measurement on."""
    config = copy.deepcopy(dict(user_config))
    config.pop("train_batch_size", None)
    config["train_micro_batch_size_per_gpu"] = candidate.micro_batch
    config.setdefault("gradient_accumulation_steps", 1)
    zero = dict(config.get("zero_optimization") or {})
    zero["stage"] = candidate.stage
    zero.pop("offload_optimizer", None)
    if candidate.offload != "none":
        zero["offload_optimizer"] = {"device": candidate.offload}
    config["zero_optimization"] = zero
    section = dict(config.get("autotuning") or {})
    section.update(
        enabled=True,
        metric_path=os.path.join(exp_dir, "metrics.json"),
        start_profile_step=tuning.start_profile_step,
        end_profile_step=tuning.end_profile_step,
        metric=tuning.metric,
    )
    config["autotuning"] = section
    return config


def with_config(
    user_args: Sequence[str], path: str, config: Mapping[str, Any], arg_mappings: Mapping[str, str]
) -> list[str]:
    """``user_args`` with the config path replaced by ``path`` and each ``arg_mappings`` flag
    set to the config's value (added when the script's arguments lack it)."""
    args = list(user_args)
    args[config_path_of(args)] = path
    for key, flag in arg_mappings.items():
        if key not in config:
            raise ValueError(
                f"autotuning.arg_mappings maps {key!r}, which the experiment config lacks; "
                "map top-level keys such as train_micro_batch_size_per_gpu"
            )
        value = str(config[key])
        if flag in args[:-1]:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    return args


def run_experiment(
    name: str,
    config: Mapping[str, Any],
    *,
    exp_dir: str,
    launcher_args: Sequence[str],
    user_script: str,
    user_args: Sequence[str],
    tuning: AutotuningConfig,
) -> dict[str, Any] | None:
    """Run one experiment (or reuse its metrics when ``overwrite`` is false); its metrics, or
    None when it failed (its ``output.log`` says why)."""
    metrics_path = os.path.join(exp_dir, "metrics.json")
    if not tuning.overwrite and os.path.exists(metrics_path):
        with open(metrics_path) as f:
            return json.load(f)
    os.makedirs(exp_dir, exist_ok=True)
    if os.path.exists(metrics_path):
        os.remove(metrics_path)
    config_path = os.path.join(exp_dir, "ds_config.json")
    with open(config_path, "w") as f:
        json.dump(config, f, indent=1)
    args = with_config(user_args, config_path, config, tuning.arg_mappings)
    cmd = [sys.executable, "-m", "ds_launch.cli", *launcher_args, user_script, *args]
    with open(os.path.join(exp_dir, "cmd.txt"), "w") as f:
        f.write(" ".join(cmd) + "\n")
    print(f"autotuning: running {name}", flush=True)
    with open(os.path.join(exp_dir, "output.log"), "w") as log:
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
    if code != 0 or not os.path.exists(metrics_path):
        print(f"autotuning: {name} failed (exit {code}); see {exp_dir}/output.log", flush=True)
        return None
    with open(metrics_path) as f:
        return json.load(f)
