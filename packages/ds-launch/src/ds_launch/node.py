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

import signal
import sys
from collections.abc import Sequence

from ds_launch._agent import PID_FILE_DIR, run_node
from ds_launch._nodespec import parse_node_argv
from ds_launch._supervise import set_parent_death_signal
from ds_launch.api import LaunchError

__all__ = ["PID_FILE_BASEPATH", "main"]

# Where --save_pid files go (DeepSpeed's launch.py name).
PID_FILE_BASEPATH = PID_FILE_DIR


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
