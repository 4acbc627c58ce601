"""Public types of ds-launch: the launch options (DeepSpeed's flag names), the plan, errors.

Nothing here imports torch: ``ds-launch --help`` must stay instant and the package installs alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ds_launch._devices import parse_core_list
from ds_launch._names import host_problem

__all__ = [
    "DEFAULT_HOSTFILE",
    "DEFAULT_LOG_LEVEL",
    "DEFAULT_MASTER_PORT",
    "LAUNCHERS",
    "LOG_LEVELS",
    "HostfileError",
    "LaunchConfig",
    "LaunchError",
    "LaunchPlan",
    "NodePlan",
    "RankPlan",
]

DEFAULT_HOSTFILE = "/job/hostfile"
DEFAULT_MASTER_PORT = 29500
# Short enough that a Ctrl-C clears every node within 5 s (see [Note: Ctrl-C within 5 s]).
DEFAULT_KILL_GRACE_S = 3.0
# Every node's agent must report within this many seconds (see [Note: every member is seen]).
DEFAULT_NODE_START_TIMEOUT_S = 180.0
# How long the other ranks may run on after one exited 0 before the job fails.
DEFAULT_EARLY_EXIT_GRACE_S = 60.0
# "local" runs every rank on this machine; the others start one job across the hostfile's nodes.
LAUNCHERS = ("local", "pdsh", "ssh", "openmpi", "mpich", "impi", "mvapich", "slurm")
# Runners that start ranks through ds-launch's node agent (so per-rank options work there).
AGENT_LAUNCHERS = ("local", "pdsh", "ssh")
# DeepSpeed's ``--log_level`` choices and default (``-q`` means ``error``).
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
DEFAULT_LOG_LEVEL = "info"


class LaunchError(Exception):
    """A launch cannot proceed; the message names the flag or file, the value and the fix."""


class HostfileError(LaunchError):
    """A hostfile line is malformed; the message starts with ``path:line:``.

    Attributes:
        path: the hostfile.
        line: 1-based line number (0 when the file as a whole is at fault).
    """

    def __init__(self, path: str, line: int, message: str) -> None:
        where = f"{path}:{line}" if line else path
        super().__init__(f"{where}: {message}")
        self.path = path
        self.line = line


def _port(flag: str, value: int | None) -> None:
    if value is not None and not 1 <= value <= 65535:
        raise LaunchError(f"{flag} {value}: not a TCP port; pass a number in 1..65535")


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """The options of one launch, named and defaulted as DeepSpeed's ``deepspeed`` flags.

    Attributes:
        user_script: the program each rank runs (a script, a module with ``module``, or an
            executable with ``no_python``).
        user_args: its arguments.
        hostfile: ``hostname slots=N`` lines; None: ``/job/hostfile`` if it exists, else this
            machine alone.
        include: resources to use, ``worker-1:0,2@worker-2`` (a host alone means all its slots).
        exclude: resources to leave out, same syntax; exclusive with ``include``.
        num_nodes: use the first N hosts (-1: all).
        num_gpus: use the first N slots of each host (-1: all); without GPUs, N CPU ranks.
        master_addr: rank 0's address; "" means 127.0.0.1 locally, else the first host's name.
        master_port: rank 0's rendezvous port.
        launcher: ``local``, ``pdsh``, ``ssh``, ``openmpi``, ``mpich``, ``impi``, ``mvapich`` or
            ``slurm`` (case-insensitive); a one-node job runs locally unless ``force_multi``.
        launcher_args: extra arguments for the launcher's tool, one shell-quoted string.
        module: run ``user_script`` as ``python -m``.
        no_python: run ``user_script`` directly, not through python.
        no_local_rank: do not pass ``--local_rank=N`` to the user program.
        force_multi: use the multi-node launcher even for one node.
        save_pid: write the node agent's pid to ``/tmp/<ds-launch pid>.deepspeed``.
        enable_each_rank_log: directory for one log file per rank (None: no files).
        bind_cores_to_rank: pin each rank to its share of the cores; sets ``OMP_NUM_THREADS``.
        bind_core_list: the cores to share out, ``0-7,16-23`` (None: all usable cores).
        ssh_port: port of the nodes' sshd (pdsh and ssh launchers).
        no_ssh: start only this machine's ranks, as node ``node_rank`` of the job; the same
            command is run on every node by other means (a scheduler, a container runtime).
        node_rank: this machine's index among the job's nodes (with ``no_ssh`` only; -1: unset).
        venv_script: a shell script every rank sources before it starts (e.g. a virtualenv's
            ``bin/activate``), relative to the launch directory unless absolute.
        log_level: the launcher's messages to print: ``debug``, ``info``, ``warning``,
            ``error`` or ``critical`` (DeepSpeed's levels; ``-q`` is ``error``).
        dry_run: print the plan as JSON and run nothing.
        kill_grace: seconds between SIGTERM and SIGKILL when stopping ranks (ds-launch only).
        node_start_timeout: seconds for every node's agent to start its ranks (pdsh and ssh);
            a node still silent then fails the job, named (ds-launch only).
        allow_early_rank_exit: a rank (or node) that exits 0 while the others run is normal;
            without it the job fails when they still run ``early_exit_grace`` seconds later.
        early_exit_grace: seconds the other ranks may run on after one exited 0.
    """

    user_script: str
    user_args: tuple[str, ...] = ()
    hostfile: str | None = None
    include: str = ""
    exclude: str = ""
    num_nodes: int = -1
    num_gpus: int = -1
    master_addr: str = ""
    master_port: int = DEFAULT_MASTER_PORT
    launcher: str = "pdsh"
    launcher_args: str = ""
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    force_multi: bool = False
    save_pid: bool = False
    enable_each_rank_log: str | None = None
    bind_cores_to_rank: bool = False
    bind_core_list: str | None = None
    ssh_port: int | None = None
    no_ssh: bool = False
    node_rank: int = -1
    venv_script: str | None = None
    log_level: str = DEFAULT_LOG_LEVEL
    dry_run: bool = False
    kill_grace: float = DEFAULT_KILL_GRACE_S
    node_start_timeout: float = DEFAULT_NODE_START_TIMEOUT_S
    allow_early_rank_exit: bool = False
    early_exit_grace: float = DEFAULT_EARLY_EXIT_GRACE_S

    def __post_init__(self) -> None:
        object.__setattr__(self, "user_args", tuple(self.user_args))
        object.__setattr__(self, "launcher", self.launcher.lower())
        object.__setattr__(self, "log_level", self.log_level.lower())
        if not self.user_script:
            raise LaunchError("no user script: pass the program to run after the ds-launch flags")
        if self.launcher not in LAUNCHERS:
            raise LaunchError(
                f"--launcher {self.launcher}: unknown launcher; use one of {', '.join(LAUNCHERS)}"
            )
        if self.include and self.exclude:
            raise LaunchError(
                f"--include {self.include!r} and --exclude {self.exclude!r} are mutually "
                "exclusive; keep one"
            )
        if (self.include or self.exclude) and (self.num_nodes >= 0 or self.num_gpus >= 0):
            flag = "--include" if self.include else "--exclude"
            raise LaunchError(
                f"{flag} cannot be combined with --num_nodes/--num_gpus (as in DeepSpeed): "
                "name the slots in the filter, or drop it and use the counts"
            )
        for flag, value in (("--num_nodes", self.num_nodes), ("--num_gpus", self.num_gpus)):
            if value == 0 or value < -1:
                raise LaunchError(f"{flag} {value}: must be >= 1 (or left out for all)")
        if self.module and self.no_python:
            raise LaunchError("--module runs `python -m`, --no_python runs no python: pick one")
        _port("--master_port", self.master_port)
        if self.master_addr and (problem := host_problem(self.master_addr)) is not None:
            raise LaunchError(f"--master_addr {self.master_addr!r} is refused: {problem}")
        _port("--ssh_port", self.ssh_port)
        if self.kill_grace < 0:
            raise LaunchError(f"--kill_grace {self.kill_grace}: must be >= 0 seconds")
        if not self.node_start_timeout > 0:
            raise LaunchError(
                f"--node_start_timeout {self.node_start_timeout}: must be > 0 seconds"
            )
        if not self.early_exit_grace >= 0:
            raise LaunchError(f"--early_exit_grace {self.early_exit_grace}: must be >= 0 seconds")
        if self.bind_core_list is not None:
            if not self.bind_cores_to_rank:
                raise LaunchError(
                    f"--bind_core_list {self.bind_core_list}: only used with --bind_cores_to_rank; "
                    "add that flag"
                )
            try:
                parse_core_list(self.bind_core_list)
            except ValueError as exc:
                raise LaunchError(f"--bind_core_list {self.bind_core_list}: {exc}") from None
        self._check_node_options()

    def _check_node_options(self) -> None:
        """``--no_ssh``/``--node_rank``, ``--venv_script`` and ``--log_level``."""
        if self.log_level not in LOG_LEVELS:
            raise LaunchError(
                f"--log_level {self.log_level}: unknown level; use one of {', '.join(LOG_LEVELS)}"
            )
        if self.venv_script is not None and not self.venv_script.strip():
            raise LaunchError("--venv_script '': empty path; name the script or drop the flag")
        if self.node_rank < -1:
            raise LaunchError(f"--node_rank {self.node_rank}: must be >= 0")
        if not self.no_ssh:
            if self.node_rank >= 0:
                raise LaunchError(
                    f"--node_rank {self.node_rank} is only used with --no_ssh (each node started "
                    "on its own); add --no_ssh, or drop --node_rank"
                )
            return
        if self.node_rank < 0:
            raise LaunchError(
                "--no_ssh needs --node_rank N: this machine's index among the job's nodes "
                "(the hostfile's order, from 0)"
            )
        if self.force_multi:
            raise LaunchError(
                "--no_ssh starts only this machine's ranks, --force_multi starts every node "
                "through a runner: pick one"
            )
        if self.launcher not in ("pdsh", "local"):
            raise LaunchError(
                f"--no_ssh starts only this machine's ranks, so --launcher {self.launcher} "
                "would not be used: drop one"
            )


@dataclass(frozen=True, kw_only=True)
class RankPlan:
    """One rank: where it runs and the command that starts it.

    Attributes:
        rank: global rank (``RANK``).
        local_rank: rank among this node's ranks (``LOCAL_RANK``).
        node_rank: index of its node (``CROSS_RANK``).
        host: its node's name in the hostfile.
        slot: its device on the node (the GPU index, or a CPU slot number).
        command: the argv the rank runs.
    """

    rank: int
    local_rank: int
    node_rank: int
    host: str
    slot: int
    command: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class NodePlan:
    """One node: its slots, its ranks, and the command started on it.

    Attributes:
        host: the node's name in the hostfile (``localhost`` without one).
        node_rank: its index in the job.
        slots: the devices its ranks use, in local-rank order.
        command: the argv that runs on the node: ds-launch's node agent (local, pdsh, ssh), or
            each rank's program (MPI and Slurm launchers start ranks themselves).
        ranks: its ranks.
    """

    host: str
    node_rank: int
    slots: tuple[int, ...]
    command: tuple[str, ...]
    ranks: tuple[RankPlan, ...]


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """Everything a launch will do, computed without running anything (``--dry_run`` prints it).

    Attributes:
        launcher: the runner used; ``local`` for a one-node job without ``--force_multi``, and
            with ``no_ssh`` (only this machine's node starts).
        world_size: total number of ranks.
        master_addr: rank 0's address as every rank sees it.
        master_port: rank 0's rendezvous port.
        exports: variables exported to every rank on every node (``NCCL_*``, ``PYTHON*``,
            ``UCX_*``, ``FI_*``, ``.deepspeed_env``...).
        commands: the argvs ds-launch starts on this machine (one per node for ``ssh``). For
            ``local`` the agent runs inside the ds-launch process; its argv is the equivalent
            ``python -m ds_launch.node`` command (of node ``node_rank`` with ``no_ssh``).
        tool_env: variables set for those commands only (e.g. ``PDSH_RCMD_TYPE``).
        files: files written before the commands run (path -> text), e.g. an MPI hostfile.
        nodes: the nodes, in rank order.
    """

    launcher: str
    world_size: int
    master_addr: str
    master_port: int
    exports: dict[str, str]
    commands: tuple[tuple[str, ...], ...]
    tool_env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    nodes: tuple[NodePlan, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (tuples become lists)."""
        return {
            "launcher": self.launcher,
            "world_size": self.world_size,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "exports": dict(self.exports),
            "commands": [list(c) for c in self.commands],
            "tool_env": dict(self.tool_env),
            "files": dict(self.files),
            "nodes": [
                {
                    "host": n.host,
                    "node_rank": n.node_rank,
                    "slots": list(n.slots),
                    "command": list(n.command),
                    "ranks": [
                        {
                            "rank": r.rank,
                            "local_rank": r.local_rank,
                            "slot": r.slot,
                            "command": list(r.command),
                        }
                        for r in n.ranks
                    ],
                }
                for n in self.nodes
            ],
        }

    def to_json(self) -> str:
        """The plan as indented JSON, as ``--dry_run`` prints it."""
        return json.dumps(self.as_dict(), indent=2)
