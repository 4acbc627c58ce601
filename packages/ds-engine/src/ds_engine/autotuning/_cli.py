"""The ``ds-autotune`` command, and what ``ds-launch --autotuning tune|run`` hands off to.

``ds-autotune --num_gpus 2 train.py --deepspeed_config ds.json`` takes ds-launch's flags and
the user's command line, as ``deepspeed --autotuning tune ...`` does, plus a few of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence

from ds_comm import ConfigError
from ds_engine.autotuning._config import AutotuningConfig
from ds_engine.autotuning._experiments import config_path_of
from ds_engine.autotuning._tuner import TuningJob, format_table, tune

__all__ = ["main"]

# ds-autotune's own options: (flags, argparse options); everything else is ds-launch's.
_OWN: tuple[tuple[str, dict[str, object]], ...] = (
    (
        "--autotuning",
        {
            "choices": ("tune", "run"),
            "default": "tune",
            "help": "tune: write the results; run: then launch the training with the best config",
        },
    ),
    (
        "--memory_per_rank",
        {
            "type": float,
            "default": None,
            "metavar": "GIB",
            "help": "memory "
            "budget per rank in GiB a candidate must be predicted to fit (default: the device's "
            "total memory on a GPU, the available host memory / ranks on CPU)",
        },
    ),
    (
        "--stages",
        {
            "default": None,
            "help": "ZeRO stages to consider, e.g. 1,2 (default: the "
            'config\'s zero_optimization.stage: a number, a list, or "all" for 0-3)',
        },
    ),
    (
        "--micro_batch_sizes",
        {
            "default": None,
            "help": "micro-batch sizes to consider, e.g. 2,4 "
            "(default: num_tuning_micro_batch_sizes values up to the largest predicted to fit)",
        },
    ),
)


def _parser() -> argparse.ArgumentParser:
    from ds_launch.cli import build_parser

    parser = build_parser()
    parser.prog = "ds-autotune"
    parser.description = (
        "Pick the ZeRO stage, micro-batch size and offload for a training script: predict "
        "each candidate's memory per rank, time only those that fit, write the best config."
    )
    group = parser.add_argument_group("autotuning")
    for flag, options in _OWN:
        if flag not in parser._option_string_actions:  # --autotuning is ds-launch's too
            group.add_argument(flag, **options)  # pyright: ignore[reportArgumentType]
    return parser


def _launcher_args(argv: Sequence[str], script_index: int) -> list[str]:
    """The ds-launch flags of ``argv`` (before the script), without ds-autotune's own."""
    own = {flag for flag, _ in _OWN}
    words, i = [], 0
    head = list(argv[:script_index])
    while i < len(head):
        word = head[i]
        name = word.split("=", 1)[0]
        if name in own:
            i += 1 if "=" in word else 2
            continue
        words.append(word)
        i += 1
    return words


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _budget(args: argparse.Namespace, world: int) -> int:
    if args.memory_per_rank is not None:
        return int(args.memory_per_rank * 2**30)
    from ds_comm.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() == "cpu":
        return int(acc.available_memory()) // max(world, 1)
    return int(acc.total_memory())


def _ints(text: str | None, flag: str) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ConfigError(f"{flag} = {text!r}: expected integers separated by commas") from None


def _config_stages(user_config: dict[str, object]) -> tuple[int, ...]:
    """DeepSpeed's rule: ``zero_optimization.stage`` a number, a list of them or ``"all"``
    (absent: 0)."""
    zero = user_config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    stages = stage if isinstance(stage, list) else [stage]
    if "all" in stages:
        return (0, 1, 2, 3)
    if not all(isinstance(s, int) and 0 <= s <= 3 for s in stages):
        raise ConfigError(
            f'zero_optimization.stage = {stage!r}: the autotuner takes 0-3, a list of them or "all"'
        )
    return tuple(stages)


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: tune (and with ``--autotuning run`` then train); the exit code."""
    words = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(words)
    try:
        job = _job(args, words)
        rows, best = tune(job)
    except (ConfigError, ValueError, RuntimeError) as exc:
        print(f"ds-autotune: error: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows, job.memory_per_rank))
    if best is None:
        print("ds-autotune: no candidate ran successfully", file=sys.stderr)
        return 1
    results = job.tuning.results_dir
    print(
        f"best ({job.tuning.metric}): {best.candidate.name}; config: "
        f"{os.path.join(results, 'ds_config_optimal.json')}"
    )
    if args.autotuning == "run":  # ("" from ds-launch's default is tune)
        with open(os.path.join(results, "cmd_optimal.txt")) as f:
            cmd = f.read().split()
        return subprocess.call(cmd)
    return 0


def _job(args: argparse.Namespace, words: list[str]) -> TuningJob:
    user_args = list(args.user_args)
    with open(user_args[config_path_of(user_args)]) as f:
        user_config = json.load(f)
    tuning = AutotuningConfig.from_section(user_config.get("autotuning"))
    world = args.num_gpus if args.num_gpus > 0 else 1
    launcher = _launcher_args(words, words.index(args.user_script))
    if not any(w.split("=", 1)[0] == "--master_port" for w in launcher):
        launcher += ["--master_port", str(_free_port())]  # experiments run one after another
    stages = _ints(args.stages, "--stages") or _config_stages(user_config)
    return TuningJob(
        launcher_args=tuple(launcher),
        user_script=args.user_script,
        user_args=tuple(user_args),
        user_config=user_config,
        tuning=tuning,
        world_size=world,
        memory_per_rank=_budget(args, world),
        stages=stages,
        micro_batch_sizes=_ints(args.micro_batch_sizes, "--micro_batch_sizes"),
    )


if __name__ == "__main__":
    sys.exit(main())
