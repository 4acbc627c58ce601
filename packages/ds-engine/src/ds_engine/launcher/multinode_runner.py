"""``deepspeed.launcher.multinode_runner``: DeepSpeed's runner classes, backed by ds-launch.

[Note: a runner is a ds-launch plan]
DeepSpeed's ``MultiNodeRunner`` subclasses turn the parsed ``deepspeed`` arguments and the
selected resources into the command its launcher starts (``get_cmd``). Here each class has
DeepSpeed's constructor, attributes and methods, and ``get_cmd`` returns the command ds-launch
itself would start for that launcher (``ds_launch.plan_launch``), so what a caller runs is what
``ds-launch --launcher NAME`` runs:

- ``args`` is the namespace of ``deepspeed.launcher.runner.parse_args`` (ds-launch's);
- ``active_resources`` (``{host: [slots]}``) becomes the plan's hostfile and ``--include``;
- the variables exported to every rank are the environment's ``EXPORT_ENVS`` ones (as
  ds-launch exports them) and every ``add_export`` (passed to the plan through a ``DS_ENV_FILE``
  it reads);
- files the command needs (the OpenMPI hostfile) are written; variables the tool needs
  (``PDSH_RCMD_TYPE``...) are set in ``environment``, as DeepSpeed's pdsh runner does.

The command differs from DeepSpeed's where ds-launch's runners do (see ``ds_launch._runners``'s
notes): pdsh starts ds-launch's node agent rather than ``deepspeed.launcher.launch``, and
include/exclude and num_nodes/num_gpus work with every launcher (DeepSpeed's OpenMPI, MPICH and
IMPI runners refuse them).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from ds_launch import LaunchError, plan_launch
from ds_launch.cli import config_from_args
from ds_launch.runner import parse_args

__all__ = [
    "IMPIRunner",
    "MPICHRunner",
    "MVAPICHRunner",
    "MultiNodeRunner",
    "OpenMPIRunner",
    "PDSHRunner",
    "SlurmRunner",
]

# Characters a shell takes literally; DeepSpeed's add_export quotes any other value.
_PLAIN = re.compile(r"[^\w@%+=:,./-]")


def _find(tool: str) -> str | None:
    """``tool`` on PATH, else beside the interpreter (where pip's mpich wheel puts mpirun)."""
    found = shutil.which(tool)
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), tool)
    return beside if os.access(beside, os.X_OK) else None


def _plan(
    launcher: str,
    args: Any,
    active_resources: Mapping[str, Sequence[int]],
    environment: Mapping[str, str],
    exports: Mapping[str, str],
) -> Any:
    """ds-launch's plan of ``launcher`` over exactly ``active_resources``."""
    with tempfile.TemporaryDirectory(prefix="ds-runner-") as scratch:
        hostfile = os.path.join(scratch, "hostfile")
        with open(hostfile, "w") as f:
            for host, slots in active_resources.items():
                f.write(f"{host} slots={max(slots) + 1}\n")
        env_file = os.path.join(scratch, "exports")
        with open(env_file, "w") as f:
            f.writelines(f"{name}={value}\n" for name, value in exports.items())
        include = "@".join(
            f"{host}:{','.join(map(str, slots))}" for host, slots in active_resources.items()
        )
        config = dataclasses.replace(
            config_from_args(args),
            launcher=launcher,
            hostfile=hostfile,
            include=include,
            exclude="",
            num_nodes=-1,
            num_gpus=-1,
            force_multi=True,
            no_ssh=False,
            dry_run=False,
        )
        environ = {**environment, "DS_ENV_FILE": env_file}
        return plan_launch(config, environ, cwd=os.getcwd())


class MultiNodeRunner:
    """A multi-node launcher: the command that starts the job on ``active_resources``.

    Args:
        args: the parsed ``deepspeed`` command line (``deepspeed.launcher.runner.parse_args``).
        world_info_base64: the selected resources, base64 JSON (``encode_world_info``); it must
            describe the same resources ``get_cmd`` is given.

    Subclasses name their launcher (``LAUNCHER``) and its tool (``TOOL``); DeepSpeed's abstract
    ``backend_exists`` and ``get_cmd`` are implemented here for all of them.

    Raises:
        ValueError: an argument combination the launcher cannot run (ds-launch's message).
    """

    LAUNCHER = ""
    TOOL = ""

    def __init__(self, args: Any, world_info_base64: str) -> None:
        self.args = args
        self.validate_args()
        self.user_arguments = self.parse_user_args()
        self.user_script = args.user_script
        self.world_info_base64 = world_info_base64
        self.exports: dict[str, str] = {}
        self._raw_exports: dict[str, str] = {}

    def backend_exists(self) -> str | None:
        """The launcher's tool (``pdsh``, ``mpirun``, ``srun``) if installed, else None."""
        return _find(self.TOOL)

    def get_cmd(
        self, environment: MutableMapping[str, str], active_resources: Mapping[str, Sequence[int]]
    ) -> list[str]:
        """The argv that starts the job on ``active_resources`` (``{host: [slots]}``); sets the
        tool's variables in ``environment`` and writes the files the command reads."""
        resources = {host: list(slots) for host, slots in active_resources.items()}
        described = json.loads(base64.urlsafe_b64decode(self.world_info_base64))
        if described != resources:
            raise ValueError(
                f"world_info_base64 describes {described} but get_cmd was given "
                f"{resources}; encode the same resources (encode_world_info(active_resources))"
            )
        self.validate_active_resources(resources)
        try:
            plan = _plan(self.name, self.args, resources, environment, self._raw_exports)
        except LaunchError as error:
            raise ValueError(str(error)) from error
        for path, text in plan.files.items():
            with open(path, "w") as f:
                f.write(text)
        environment.update(plan.tool_env)
        return list(plan.commands[0])

    def add_export(self, key: str, var: str) -> None:
        """Export ``key=var`` to every rank (``exports`` keeps it shell-quoted, as DeepSpeed)."""
        key, var = key.strip(), var.strip()
        if "\n" in var:
            raise ValueError(f"add_export({key!r}, ...): a value cannot span lines")
        self._raw_exports[key] = var
        self.exports[key] = f'"{var}"' if _PLAIN.search(var) else var

    def parse_user_args(self) -> list[str]:
        """The user script's arguments (ds-launch quotes them for the tool's shell itself)."""
        return list(self.args.user_args)

    @property
    def name(self) -> str:
        """The ``--launcher`` value."""
        return self.LAUNCHER

    def validate_args(self) -> None:
        """ds-launch's checks of the arguments for this launcher (ValueError naming the flag)."""
        try:
            dataclasses.replace(config_from_args(self.args), launcher=self.name)
        except LaunchError as error:
            raise ValueError(str(error)) from error

    @classmethod
    def validate_active_resources(cls, active_resources: Mapping[str, Sequence[int]]) -> None:
        """Whether this launcher can start exactly ``active_resources`` (ValueError if not)."""
        try:
            _plan(cls.LAUNCHER, parse_args(["probe.py"]), active_resources, {}, {})
        except LaunchError as error:
            raise ValueError(str(error)) from error


class PDSHRunner(MultiNodeRunner):
    """``--launcher pdsh``: pdsh starts ds-launch's node agent on every node."""

    LAUNCHER, TOOL = "pdsh", "pdsh"


class _PoolRunner(MultiNodeRunner):
    """The runners DeepSpeed also gives the hostfile's ``resource_pool`` (``{host: slots}``)."""

    def __init__(self, args: Any, world_info_base64: str, resource_pool: Mapping[str, int]):
        super().__init__(args, world_info_base64)
        self.resource_pool = resource_pool


class OpenMPIRunner(_PoolRunner):
    """``--launcher openmpi``: ``mpirun`` starts every rank (``UCX_TLS=tcp`` exported, as in
    DeepSpeed)."""

    LAUNCHER, TOOL = "openmpi", "mpirun"

    def __init__(self, args: Any, world_info_base64: str, resource_pool: Mapping[str, int]):
        super().__init__(args, world_info_base64, resource_pool)
        self.add_export("UCX_TLS", "tcp")


class MPICHRunner(_PoolRunner):
    """``--launcher mpich``: MPICH's ``mpirun`` starts every rank."""

    LAUNCHER, TOOL = "mpich", "mpirun"


class IMPIRunner(_PoolRunner):
    """``--launcher impi``: Intel MPI's ``mpirun`` starts every rank."""

    LAUNCHER, TOOL = "impi", "mpirun"


class SlurmRunner(_PoolRunner):
    """``--launcher slurm``: ``srun`` starts every rank (same slot count on every host)."""

    LAUNCHER, TOOL = "slurm", "srun"


class MVAPICHRunner(_PoolRunner):
    """``--launcher mvapich``: MVAPICH's ``mpirun`` starts every rank, with DeepSpeed's ``MV2_*``
    defaults (added by ds-launch)."""

    LAUNCHER, TOOL = "mvapich", "mpirun"
