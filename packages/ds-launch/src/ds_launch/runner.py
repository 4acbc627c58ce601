"""DeepSpeed's ``deepspeed.launcher.runner`` names, backed by ds-launch.

Clients import these from DeepSpeed's runner module (``accelerate launch`` reads
``DEEPSPEED_ENVIRONMENT_NAME`` to know which file to append its variables to); the ``ds_engine``
namespace re-exports them as ``ds_engine.launcher.runner``. Each has DeepSpeed's signature and
meaning, computed by the code ds-launch itself runs, so what a client reads here is what the
launcher does. Where ds-launch is stricter or keeps more than DeepSpeed, the docstring says so.
Like the rest of ds-launch, this module imports no torch.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ds_launch._exports import ENV_FILE_NAME, EXPORT_PREFIXES
from ds_launch._exports import EXCLUDE_ENVS as _EXCLUDE_ENVS
from ds_launch._hostfile import parse_hostfile
from ds_launch._nodespec import encode_world_info as _encode_world_info
from ds_launch._resources import select_resources
from ds_launch._runners import PDSH_FAN_OUT
from ds_launch.api import DEFAULT_HOSTFILE, DEFAULT_MASTER_PORT, LaunchError
from ds_launch.cli import main as _cli_main
from ds_launch.cli import parse_args as _cli_parse_args

__all__ = [
    # constants
    "DEEPSPEED_ENVIRONMENT_NAME",
    "DEEPSPEED_ENVIRONMENT_PATHS",
    "DLTS_HOSTFILE",
    "EXCLUDE_ENVS",
    "EXPORT_ENVS",
    "IMPI_LAUNCHER",
    "MPICH_LAUNCHER",
    "MVAPICH_LAUNCHER",
    "OPENMPI_LAUNCHER",
    "PDSH_LAUNCHER",
    "PDSH_MAX_FAN_OUT",
    "SLURM_LAUNCHER",
    "TORCH_DISTRIBUTED_DEFAULT_PORT",
    # command line
    "main",
    "parse_args",
    # resources
    "encode_world_info",
    "fetch_hostfile",
    "parse_inclusion_exclusion",
    "parse_resource_filter",
]

DLTS_HOSTFILE = DEFAULT_HOSTFILE
# The file of NAME=VALUE lines exported to every rank: DS_ENV_FILE when set at import, as in
# DeepSpeed (ds-launch itself reads DS_ENV_FILE at each launch; see ds_launch._exports).
DEEPSPEED_ENVIRONMENT_NAME = os.environ.get("DS_ENV_FILE", ENV_FILE_NAME)
# Where that file is looked for, lowest precedence first.
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
# Name prefixes of the launcher variables exported to every rank. DeepSpeed's list is
# ['MLFLOW', 'PYTHON', 'MV2', 'UCX'] plus its accelerator's (NCCL); ds-launch's also has FI_.
EXPORT_ENVS = list(EXPORT_PREFIXES)
PDSH_MAX_FAN_OUT = PDSH_FAN_OUT
# When the key is set in the launcher's environment, the listed variables are not exported.
EXCLUDE_ENVS = {key: list(names) for key, names in _EXCLUDE_ENVS.items()}
TORCH_DISTRIBUTED_DEFAULT_PORT = DEFAULT_MASTER_PORT
# --launcher values.
PDSH_LAUNCHER = "pdsh"
OPENMPI_LAUNCHER = "openmpi"
MPICH_LAUNCHER = "mpich"
IMPI_LAUNCHER = "impi"
SLURM_LAUNCHER = "slurm"
MVAPICH_LAUNCHER = "mvapich"


def parse_args(args: Sequence[str] | None = None) -> Any:
    """The ``deepspeed`` command line parsed: an ``argparse.Namespace`` with DeepSpeed's
    attribute names (``hostfile``, ``include``, ``num_gpus``, ``user_script``, ``user_args``...)
    and ds-launch's own (``dry_run``, ``kill_grace``). ``args`` defaults to ``sys.argv[1:]``.

    ``hostfile`` is None when not given (ds-launch then uses ``/job/hostfile`` if it exists);
    DeepSpeed's default is the string ``"/job/hostfile"``.
    """
    return _cli_parse_args(args)


def main(args: Sequence[str] | None = None) -> None:
    """Run the ``deepspeed`` launcher on ``args`` (default ``sys.argv[1:]``).

    Returns None when the job succeeds; as in DeepSpeed, a failing job exits the process with
    its code (``SystemExit``), and so does a usage error (code 2, after the reason is printed).

    Example:
        >>> main(["--num_gpus", "2", "train.py", "--deepspeed_config", "ds.json"])
    """
    code = _cli_main(args)
    if code:
        raise SystemExit(code)


def fetch_hostfile(hostfile_path: str) -> collections.OrderedDict[str, int] | None:
    """``{host: slot count}`` from an MPI-style hostfile, or None if there is no such file
    (DeepSpeed then launches on local resources).

    Raises:
        ValueError: a malformed line, a repeated host, or no hosts; the message names the file
            and line. ds-launch also refuses ``slots=0``.
    """
    if not os.path.isfile(hostfile_path):
        return None
    try:
        return collections.OrderedDict(parse_hostfile(hostfile_path))
    except LaunchError as exc:
        raise ValueError(str(exc)) from None


def parse_resource_filter(
    host_info: Mapping[str, Sequence[int]], include_str: str = "", exclude_str: str = ""
) -> collections.OrderedDict[str, list[int]]:
    """Filter ``{host: slots}`` by an ``--include`` or ``--exclude`` string.

    The syntax is ``NODE_SPEC[@NODE_SPEC ...]`` with ``NODE_SPEC = NAME[:SLOT[,SLOT ...]]``; a
    host without slots means all of its slots. Hosts keep ``host_info``'s order. ds-launch
    keeps an included host's slots in the order written (``w:2,0`` puts local rank 0 on slot
    2), where DeepSpeed sorts them, and refuses a host named twice or an exclusion that leaves
    nothing, where DeepSpeed merges or returns an empty pool.

    Raises:
        ValueError: both strings given, an unknown host or slot, or a malformed spec.

    Example:
        >>> parse_resource_filter({"w0": [0, 1], "w1": [0, 1]}, exclude_str="w1:0")
        OrderedDict({'w0': [0, 1], 'w1': [1]})
    """
    if include_str and exclude_str:
        raise ValueError("include_str and exclude_str are mutually exclusive.")
    pool = {host: list(slots) for host, slots in host_info.items()}
    try:
        selected = select_resources(pool, include=include_str, exclude=exclude_str)
    except LaunchError as exc:
        raise ValueError(str(exc)) from None
    return collections.OrderedDict(selected)


def parse_inclusion_exclusion(
    resource_pool: Mapping[str, int], inclusion: str, exclusion: str
) -> collections.OrderedDict[str, list[int]]:
    """``parse_resource_filter`` over a pool of slot counts (``fetch_hostfile``'s result):
    each host's slots are ``0..N-1``.

    Raises:
        ValueError: as ``parse_resource_filter``.
    """
    pool = {host: list(range(count)) for host, count in resource_pool.items()}
    return parse_resource_filter(pool, include_str=inclusion, exclude_str=exclusion)


def encode_world_info(world_info: Mapping[str, Sequence[int]]) -> str:
    """``{host: slots}`` as URL-safe base64 of its JSON: the ``--world_info`` value that the
    per-node launcher (``python -m ds_launch.node``, DeepSpeed's ``deepspeed.launcher.launch``)
    reads.

    Example:
        >>> encode_world_info({"localhost": [0, 1]})
        'eyJsb2NhbGhvc3QiOiBbMCwgMV19'
    """
    return _encode_world_info(world_info)
