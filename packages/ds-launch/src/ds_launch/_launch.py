"""Run a launch: the local agent in-process, or the runner's tools under supervision."""

from __future__ import annotations

import os
import sys

from ds_launch._agent import run_node
from ds_launch._plan import build
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
    if built.hint:
        print(f"ds-launch: {built.hint}", file=sys.stderr)
    if built.local_node is not None:
        return run_node(built.local_node)
    for path, text in built.plan.files.items():
        with open(path, "w", encoding="utf-8") as fd:
            fd.write(text)
    try:
        noun = "node" if built.plan.launcher == "ssh" else "process"
        outcome = supervise(built.tools, kill_grace=config.kill_grace, noun=noun)
    finally:
        for path in built.plan.files:
            os.unlink(path)
    report_failure(outcome, with_tail=False)
    return outcome.exit_code
