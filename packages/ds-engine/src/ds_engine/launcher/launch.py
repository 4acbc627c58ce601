"""``deepspeed.launcher.launch``: the per-node launcher, provided by ds-launch's node agent.

``python -m ds_engine.launcher.launch --world_info=... --node_rank=N ... script args`` takes
DeepSpeed's ``launch.py`` flags and starts this node's ranks (see ``ds_launch.node``).
"""

from __future__ import annotations

import sys

from ds_launch.node import (
    CROSS_RANK,
    CROSS_SIZE,
    PID_FILE_BASEPATH,
    TORCH_DISTRIBUTED_DEFAULT_PORT,
    main,
    parse_args,
    terminate_process_tree,
)

__all__ = [
    "CROSS_RANK",
    "CROSS_SIZE",
    "PID_FILE_BASEPATH",
    "TORCH_DISTRIBUTED_DEFAULT_PORT",
    "main",
    "parse_args",
    "terminate_process_tree",
]

if __name__ == "__main__":
    sys.exit(main())
