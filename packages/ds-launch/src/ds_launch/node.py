"""ds-launch's per-node agent: ``python -m ds_launch.node --world_info=... --node_rank=N ... script``.

It takes the flags of DeepSpeed's per-node launcher (``python -m deepspeed.launcher.launch``)
with their defaults: ``--world_info``, ``--node_rank`` (0), ``--master_addr`` (127.0.0.1),
``--master_port`` (29500), ``--module``, ``--no_python``, ``--no_local_rank``, ``--save_pid PID``,
``--enable_each_rank_log DIR``, ``--bind_cores_to_rank``, ``--bind_core_list``, ``--log_level``,
``-q``; and ds-launch's ``--node_host``, ``--venv_script``, ``--cpu`` and ``--kill_grace``.

The pdsh and ssh runners start one agent per node; the local launcher runs the same code inside
the ds-launch process. The agent starts the node's ranks with their launch variables, prefixes
their output with ``[rankN]``, forwards SIGINT/SIGTERM/SIGHUP, stops every rank when one fails,
and exits with the failing rank's code.

A remote agent is the direct child of sshd (its command ``exec``s it) and asks the kernel for
SIGTERM when that parent exits: a dropped connection, or the launcher killing its ssh/pdsh,
stops the node's ranks like a Ctrl-C would.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from ds_launch._agent import PID_FILE_DIR, run_node
from ds_launch._nodespec import parse_node_args, parse_node_argv
from ds_launch._supervise import set_parent_death_signal, terminate_tree
from ds_launch.api import DEFAULT_MASTER_PORT, LaunchError

__all__ = [
    # DeepSpeed's launch.py names
    "CROSS_RANK",
    "CROSS_SIZE",
    "PID_FILE_BASEPATH",
    "TORCH_DISTRIBUTED_DEFAULT_PORT",
    "main",
    "parse_args",
    "terminate_process_tree",
]

# Where --save_pid files go.
PID_FILE_BASEPATH = PID_FILE_DIR
# The variables holding a rank's node index and the node count.
CROSS_RANK = "CROSS_RANK"
CROSS_SIZE = "CROSS_SIZE"
TORCH_DISTRIBUTED_DEFAULT_PORT = DEFAULT_MASTER_PORT


def parse_args(args: Sequence[str] | None = None) -> argparse.Namespace:
    """The agent's command line (``sys.argv[1:]`` by default) parsed, with DeepSpeed's
    ``launch.py`` attribute names (``node_rank``, ``world_info``, ``training_script``,
    ``training_script_args``...).

    Raises:
        SystemExit: the arguments do not parse (argparse prints the usage).
    """
    return parse_node_args(sys.argv[1:] if args is None else args)


def terminate_process_tree(pid: int) -> None:
    """SIGTERM ``pid`` and every descendant, SIGKILL those still running 30 s later."""
    terminate_tree(pid, timeout=30.0)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the agent; returns the node's exit code (2 for a bad command line)."""
    try:
        spec = parse_node_argv(sys.argv[1:] if argv is None else argv)
        set_parent_death_signal(signal.SIGTERM)
        return run_node(spec)
    except LaunchError as exc:
        print(f"ds-launch node: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
