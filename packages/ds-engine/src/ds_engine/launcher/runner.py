"""``deepspeed.launcher.runner``: the ``deepspeed`` command's module, provided by ds-launch.

``python -m ds_engine.launcher.runner ARGS`` runs ``ds-launch ARGS``. See ``ds_launch.runner``
for each name's meaning and where ds-launch differs from DeepSpeed.
"""

from __future__ import annotations

from ds_launch.runner import (
    DEEPSPEED_ENVIRONMENT_NAME,
    DEEPSPEED_ENVIRONMENT_PATHS,
    DLTS_HOSTFILE,
    EXCLUDE_ENVS,
    EXPORT_ENVS,
    IMPI_LAUNCHER,
    MPICH_LAUNCHER,
    MVAPICH_LAUNCHER,
    OPENMPI_LAUNCHER,
    PDSH_LAUNCHER,
    PDSH_MAX_FAN_OUT,
    SLURM_LAUNCHER,
    TORCH_DISTRIBUTED_DEFAULT_PORT,
    encode_world_info,
    fetch_hostfile,
    main,
    parse_args,
    parse_inclusion_exclusion,
    parse_resource_filter,
)

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

if __name__ == "__main__":
    main()
