"""``deepspeed.launcher.launch``: the per-node launcher, provided by ds-launch's node agent.

``python -m ds_engine.launcher.launch --world_info=... --node_rank=N ... script args`` takes
DeepSpeed's ``launch.py`` flags and starts this node's ranks (see ``ds_launch.node``).
"""

from __future__ import annotations

import sys

from ds_launch.node import PID_FILE_BASEPATH, main

__all__ = ["PID_FILE_BASEPATH", "main"]

if __name__ == "__main__":
    sys.exit(main())
