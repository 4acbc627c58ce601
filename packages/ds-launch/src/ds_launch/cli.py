"""The ``ds-launch`` command: DeepSpeed's ``deepspeed`` launcher flags, same meanings.

``deepspeed --num_gpus 4 train.py --deepspeed_config ds.json`` becomes
``ds-launch --num_gpus 4 train.py --deepspeed_config ds.json``. The package imports only the
standard library, so the command starts in tens of milliseconds; torch is never imported (see
``_devices.py`` for GPU discovery).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from ds_launch.api import (
    DEFAULT_EARLY_EXIT_GRACE_S,
    DEFAULT_HOSTFILE,
    DEFAULT_KILL_GRACE_S,
    DEFAULT_LOG_LEVEL,
    DEFAULT_MASTER_PORT,
    DEFAULT_NODE_START_TIMEOUT_S,
    LAUNCHERS,
    LOG_LEVELS,
    LaunchConfig,
    LaunchError,
)

__all__ = ["build_parser", "config_from_args", "main", "parse_args"]

# DeepSpeed launcher flags ds-launch does not implement: what to do instead. Using one is an
# error that says so. They are older DeepSpeed's.
_UNSUPPORTED = {
    "--elastic_training": "elastic training is not part of ds; restart the job with the new "
    "node count (checkpoints reshard on load)",
    "--min_elastic_nodes": "elastic training is not part of ds; pick the node count with "
    "--num_nodes",
    "--max_elastic_nodes": "elastic training is not part of ds; pick the node count with "
    "--num_nodes",
    "--comment": "pass srun's --comment through --launcher_args",
    "--detect_nvlink_pairs": "pick the GPUs with --include or CUDA_VISIBLE_DEVICES",
}
# Those of them that take no value.
_SWITCHES = ("--elastic_training", "--detect_nvlink_pairs")


_FLAGS: dict[str, tuple[tuple[tuple[str, ...], dict[str, Any]], ...]] = {
    "resources": (
        (("-H", "--hostfile"), {"default": None, "help": "`hostname slots=N` lines; default "
            f"{DEFAULT_HOSTFILE} if it exists, else this machine"}),
        (("-i", "--include"), {"default": "", "help": "resources to use: "
            "NODE[:SLOT[,SLOT...]][@NODE...], e.g. 'worker-1:0,2@worker-2' (a host alone means "
            "all its slots)"}),
        (("-e", "--exclude"), {"default": "", "help": "resources to leave out, same syntax; "
            "exclusive with --include"}),
        (("--num_nodes",), {"type": int, "default": -1, "help": "use the first N hosts"}),
        (("--num_gpus", "--num_accelerators"), {"type": int, "default": -1, "help": "use the "
            "first N slots of each host; without GPUs, N CPU ranks (default 1)"}),
    ),
    "rendezvous and runner": (
        (("--master_addr",), {"default": "", "help": "rank 0's address; default 127.0.0.1 on "
            "one machine, else the first host's name"}),
        (("--master_port",), {"type": int, "default": DEFAULT_MASTER_PORT,
            "help": "rank 0's rendezvous port"}),
        (("--launcher",), {"default": "pdsh", "help": f"multi-node runner: {', '.join(LAUNCHERS)}"
            " (one node runs locally unless --force_multi)"}),
        (("--launcher_args",), {"default": "", "help": "extra arguments for the runner's tool, "
            "as one quoted string"}),
        (("--force_multi",), {"action": "store_true", "help": "use the multi-node runner even "
            "for one node"}),
        (("--ssh_port",), {"type": int, "default": None, "help": "sshd port of the nodes"}),
        (("--no_ssh_check",), {"action": "store_true", "help": "accepted for DeepSpeed "
            "compatibility; ds-launch runs no ssh pre-check"}),
        (("--no_ssh",), {"action": "store_true", "help": "start only this machine's ranks, as "
            "node --node_rank of the hostfile; run the same command on every node yourself"}),
        (("--node_rank",), {"type": int, "default": -1, "help": "this machine's index among "
            "the job's nodes, 0..N-1 (with --no_ssh only)"}),
        (("--venv_script",), {"default": None, "metavar": "SCRIPT", "help": "shell script each"
            " rank sources before it starts, e.g. a virtualenv's bin/activate"}),
    ),
    "user program": (
        (("-m", "--module"), {"action": "store_true", "help": "run the user script as a module "
            "(python -m)"}),
        (("--no_python",), {"action": "store_true", "help": "run the user program directly, "
            "not through python"}),
        (("--no_local_rank",), {"action": "store_true", "help": "do not pass --local_rank=N to "
            "the user program"}),
        (("--autotuning",), {"default": "", "choices": ("tune", "run"), "help": "tune: run "
            "ds-autotune (predict each candidate's memory, time those that fit, write the best "
            "config to autotuning.results_dir); run: then train with it"}),
    ),
    "ranks": (
        (("--enable_each_rank_log",), {"default": None, "metavar": "DIR", "help": "also write "
            "each rank's output to DIR/<time>_rank<N>.log"}),
        (("--bind_cores_to_rank",), {"action": "store_true", "help": "pin each rank to its share"
            " of the cores and set OMP_NUM_THREADS"}),
        (("--bind_core_list",), {"default": None, "help": "cores to share out, e.g. 0-15,32-47 "
            "(default: all usable cores)"}),
        (("--save_pid",), {"action": "store_true", "help": "write the node agent's pid to "
            "/tmp/<ds-launch pid>.deepspeed"}),
        (("--kill_grace",), {"type": float, "default": DEFAULT_KILL_GRACE_S, "help": "seconds "
            "between SIGTERM and SIGKILL when stopping ranks (ds-launch only)"}),
        (("--node_start_timeout",), {"type": float, "default": DEFAULT_NODE_START_TIMEOUT_S,
            "metavar": "SECONDS", "help": "pdsh/ssh: fail, naming them, when nodes have not "
            f"started their ranks after this long (default {DEFAULT_NODE_START_TIMEOUT_S:g})"}),
        (("--allow_early_rank_exit",), {"action": "store_true", "help": "a rank that exits 0 "
            "while others run is normal (default: the job fails when they still run "
            "--early_exit_grace seconds later)"}),
        (("--early_exit_grace",), {"type": float, "default": DEFAULT_EARLY_EXIT_GRACE_S,
            "metavar": "SECONDS", "help": "how long the other ranks may run on after one "
            f"exited 0 (default {DEFAULT_EARLY_EXIT_GRACE_S:g})"}),
        (("--dry_run",), {"action": "store_true", "help": "print each node's command and the "
            "resource map as JSON; run nothing"}),
    ),
    "messages": (
        (("--log_level",), {"default": DEFAULT_LOG_LEVEL, "choices": LOG_LEVELS, "help": "the "
            "launcher's messages to print (default info); ranks' output is never filtered"}),
        (("-q", "--quiet"), {"action": "store_true", "help": "print only errors: "
            "--log_level error"}),
    ),
}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The ``ds-launch`` argument parser (DeepSpeed's flag names and defaults)."""
    parser = argparse.ArgumentParser(
        prog="ds-launch",
        description="Launch a distributed job on this machine or across a cluster. Takes the "
        "`deepspeed` launcher's flags with the same meaning.",
        allow_abbrev=False,  # else --no_ssh would be taken as --no_ssh_check, and so on
    )
    for title, flags in _FLAGS.items():
        group = parser.add_argument_group(title)
        for names, options in flags:
            group.add_argument(*names, **options)
    for flag in _UNSUPPORTED:
        value: dict[str, Any] = (
            {"action": "store_const", "const": True} if flag in _SWITCHES else {"nargs": "?"}
        )
        parser.add_argument(flag, default=None, help=argparse.SUPPRESS, **value)
    parser.add_argument("user_script", help="the program every rank runs")
    parser.add_argument("user_args", nargs=argparse.REMAINDER, help="its arguments")
    return parser


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """A ``LaunchConfig`` from parsed arguments.

    Raises:
        LaunchError: a DeepSpeed flag ds-launch does not support, or invalid values.
    """
    for flag, why in _UNSUPPORTED.items():
        if getattr(args, flag.lstrip("-")) is not None:
            raise LaunchError(f"{flag} is not implemented by ds-launch: {why}")
    log_dir = args.enable_each_rank_log
    return LaunchConfig(
        user_script=args.user_script,
        user_args=tuple(args.user_args),
        hostfile=args.hostfile,
        include=args.include,
        exclude=args.exclude,
        num_nodes=args.num_nodes,
        num_gpus=args.num_gpus,
        master_addr=args.master_addr,
        master_port=args.master_port,
        launcher=args.launcher,
        launcher_args=args.launcher_args,
        module=args.module,
        no_python=args.no_python,
        no_local_rank=args.no_local_rank,
        force_multi=args.force_multi,
        save_pid=args.save_pid,
        # DeepSpeed's default for this flag is the string "None".
        enable_each_rank_log=None if log_dir in (None, "None") else log_dir,
        bind_cores_to_rank=args.bind_cores_to_rank,
        bind_core_list=args.bind_core_list,
        ssh_port=args.ssh_port,
        no_ssh=args.no_ssh,
        node_rank=args.node_rank,
        venv_script=args.venv_script,
        log_level="error" if args.quiet else args.log_level,
        dry_run=args.dry_run,
        kill_grace=args.kill_grace,
        node_start_timeout=args.node_start_timeout,
        allow_early_rank_exit=args.allow_early_rank_exit,
        early_exit_grace=args.early_exit_grace,
    )


def _attach_launcher_args(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--launcher_args "-i key -p 22"`` -> ``--launcher_args=-i key -p 22``.

    argparse reads a separate value starting with ``-`` as an option (here even as ``-i``), so
    the value is attached before parsing. Only ds-launch's own options, before the user script,
    are looked at.
    """
    actions = parser._option_string_actions
    index = 0
    while index < len(argv):
        word = argv[index]
        if word == "--" or not word.startswith("-") or word == "-":
            break
        action = actions.get(word)
        takes_value = action is not None and action.nargs is None and "=" not in word
        if word == "--launcher_args" and index + 1 < len(argv):
            return [*argv[:index], f"{word}={argv[index + 1]}", *argv[index + 2 :]]
        index += 2 if takes_value else 1
    return argv


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse a ``ds-launch`` (or ``deepspeed``) command line, ``sys.argv[1:]`` by default.

    Raises:
        SystemExit: the command line does not parse (argparse prints the usage).
    """
    parser = build_parser()
    words = list(sys.argv[1:] if args is None else args)
    return parser.parse_args(_attach_launcher_args(parser, words))


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: parse, launch, return the exit code (2 for a usage error)."""
    words = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(words)
    if args.autotuning:
        return _autotune(words)
    try:
        config = config_from_args(args)
        from ds_launch._launch import launch  # after parsing: --help and usage errors stay fast

        return launch(config)
    except LaunchError as exc:
        print(f"ds-launch: error: {exc}", file=sys.stderr)
        return 2


def _autotune(words: list[str]) -> int:
    """``--autotuning tune|run``: hand the whole command line to ds-engine's ``ds-autotune``
    in a new process (ds-launch itself never imports torch)."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("ds_engine") is None:
        print("ds-launch: error: --autotuning needs ds-engine installed (it runs ds-autotune)",
              file=sys.stderr)  # fmt: skip
        return 2
    return subprocess.call([sys.executable, "-m", "ds_engine.autotuning", *words])


if __name__ == "__main__":
    sys.exit(main())
