"""The environment every rank on every node receives, whichever runner starts it.

[Note: exported variables]
Remote nodes start from sshd's (or the MPI daemon's) bare environment, so the launcher carries
over, as DeepSpeed does:

* every variable of its own environment whose name starts with ``NCCL_``, ``PYTHON``, ``UCX_``,
  ``FI_`` (libfabric, as used by EFA), ``MV2_`` or ``MLFLOW_``; except, when ``AISC_JOB_NAME`` is set (nodes that set their own network variables),
  ``NCCL_IB_HCA`` and ``UCX_NET_DEVICES`` (DeepSpeed's ``EXCLUDE_ENVS``);
* for multi-node runners, ``PYTHONPATH`` with the launch directory in front (ranks ``cd`` there);
* the ``NAME=VALUE`` lines of ``.deepspeed_env`` files: ``~/.deepspeed_env`` then
  ``./.deepspeed_env``, both read, the current directory's values winning. ``DS_ENV_FILE`` names
  another file: a path (absolute or relative to the current directory) if it exists, otherwise
  a file name looked up in those two directories; finding nothing is then an error, not a silent
  launch without the variables the user asked for.

ds-launch's own per-rank variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``...) are never taken
from the launcher's environment: each agent sets them, and MPI runners leave rank discovery to
the MPI launcher's variables.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ds_launch._hostfile import parse_env_file
from ds_launch._names import is_variable_name
from ds_launch.api import LaunchError

EXPORT_PREFIXES = ("NCCL_", "PYTHON", "UCX_", "FI_", "MV2_", "MLFLOW_")
# When the key is set, each node sets these itself: rank 0's values are not exported.
EXCLUDE_ENVS = {"AISC_JOB_NAME": ("NCCL_IB_HCA", "UCX_NET_DEVICES")}
ENV_FILE_NAME = ".deepspeed_env"
LAUNCH_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "LOCAL_SIZE",
    "CROSS_RANK",
    "CROSS_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def env_files(environ: Mapping[str, str], cwd: str, home: str) -> list[str]:
    """The ``.deepspeed_env`` files to read, lowest precedence first.

    Raises:
        LaunchError: ``DS_ENV_FILE`` is set but names no file.
    """
    name = environ.get("DS_ENV_FILE") or ENV_FILE_NAME
    if name != ENV_FILE_NAME:
        direct = os.path.join(cwd, name)  # an absolute name stays as it is
        if os.path.isfile(direct):
            return [direct]
    found = [
        path
        for path in dict.fromkeys(os.path.join(d, name) for d in (home, cwd))
        if os.path.isfile(path)
    ]
    if not found and name != ENV_FILE_NAME:
        raise LaunchError(
            f"DS_ENV_FILE={name}: no such file (looked for it as a path and in {home} and {cwd}); "
            "fix the name or unset DS_ENV_FILE"
        )
    return found


def collect_exports(
    environ: Mapping[str, str], *, cwd: str, home: str, multi_node: bool
) -> dict[str, str]:
    """The variables to export to every rank (see [Note: exported variables]).

    Raises:
        LaunchError: ``DS_ENV_FILE`` names no file, or an env file line is malformed.
    """
    excluded = {name for key, names in EXCLUDE_ENVS.items() if key in environ for name in names}
    exports = {
        name: value
        for name, value in sorted(environ.items())
        if name.startswith(EXPORT_PREFIXES)
        and name not in LAUNCH_VARS
        and name not in excluded
        and is_variable_name(name)  # a name no shell could set is no variable to pass on
    }
    if multi_node:
        path = environ.get("PYTHONPATH")
        exports["PYTHONPATH"] = f"{cwd}{os.pathsep}{path}" if path else cwd
    for env_file in env_files(environ, cwd, home):
        exports.update(parse_env_file(env_file))
    return exports


def without_launch_vars(environ: Mapping[str, str]) -> dict[str, str]:
    """A copy of ``environ`` without ds-launch's per-rank variables."""
    return {name: value for name, value in environ.items() if name not in LAUNCH_VARS}
