"""Run a launch: the local agent in-process, or the runner's tools under supervision."""

from __future__ import annotations

import os
import shlex

from ds_launch._agent import run_node
from ds_launch._log import Console
from ds_launch._plan import Built, build
from ds_launch._supervise import report_failure, supervise
from ds_launch.api import LaunchConfig


def launch(config: LaunchConfig) -> int:
    """Run (or, with ``dry_run``, print) a launch; returns the job's exit code.

    Raises:
        LaunchError: the launch cannot start; the message says why and how to fix it.

    Example:
        >>> launch(LaunchConfig(user_script="train.py", num_gpus=2))  # two local ranks
        0
    """
    built = build(
        config, os.environ, cwd=os.getcwd(), home=os.path.expanduser("~"), pid=os.getpid()
    )
    if config.dry_run:
        print(built.plan.to_json())
        return 0
    console = Console(config.log_level)
    _announce(console, built)
    if built.local_node is not None:
        return run_node(built.local_node)
    for path, text in built.plan.files.items():
        with open(path, "w", encoding="utf-8") as fd:
            fd.write(text)
    try:
        noun = "node" if built.plan.launcher == "ssh" else "process"
        outcome = supervise(
            built.tools,
            kill_grace=config.kill_grace,
            noun=noun,
            console=console,
            watch=built.watch,
        )
    finally:
        for path in built.plan.files:
            os.unlink(path)
    report_failure(outcome, with_tail=False, console=console)
    return outcome.exit_code


def _announce(console: Console, built: Built) -> None:
    """What the launch is about to do, at the levels of [Note: launcher messages]."""
    plan = built.plan
    if built.hint:
        console.warning(built.hint)
    resources = {node.host: list(node.slots) for node in plan.nodes}
    console.info(
        f"{plan.launcher} launch of {plan.world_size} rank(s) on {resources}, master "
        f"{plan.master_addr}:{plan.master_port}"
    )
    for path in built.env_files:
        console.info(f"exporting the variables of {path}")
    exported = " ".join(f"{name}={value}" for name, value in plan.exports.items())
    console.debug(f"exported to every rank: {exported or '(nothing)'}")
    for name, value in plan.tool_env.items():
        console.debug(f"runner environment: {name}={value}")
    for argv in plan.commands:
        if built.local_node is not None and argv[0] == "env":  # exported values: debug above
            argv = argv[next(i for i, word in enumerate(argv[1:], 1) if "=" not in word) :]
        console.info(f"cmd = {shlex.join(argv)}")
