"""ds-launch: start a job on one machine or a cluster, with DeepSpeed's ``deepspeed`` flags.

The ``ds-launch`` console script is the main interface; the functions below build and run the
same launches from Python. Importing this package never imports torch.
"""

from __future__ import annotations

from ds_launch._hostfile import parse_hostfile
from ds_launch._launch import launch
from ds_launch._plan import plan_launch
from ds_launch._resources import select_resources
from ds_launch.api import (
    HostfileError,
    LaunchConfig,
    LaunchError,
    LaunchPlan,
    NodePlan,
    RankPlan,
)

__version__ = "0.2.0"

__all__ = [
    # launching
    "LaunchConfig",
    "launch",
    "plan_launch",
    "LaunchPlan",
    "NodePlan",
    "RankPlan",
    # resources
    "parse_hostfile",
    "select_resources",
    # errors
    "LaunchError",
    "HostfileError",
    "__version__",
]
