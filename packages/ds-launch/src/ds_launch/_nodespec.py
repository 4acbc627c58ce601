"""What one node's agent runs: the job layout, this node's index, and the user program.

The launcher builds a ``NodeSpec`` per node; ``to_argv`` turns it into the
``python -m ds_launch.node`` command line for remote nodes and ``parse_node_argv`` reads it back,
so the two can never drift apart. The local launcher hands the spec to the agent in-process.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ds_launch._names import bad_host, host_problem
from ds_launch.api import (
    DEFAULT_EARLY_EXIT_GRACE_S,
    DEFAULT_KILL_GRACE_S,
    DEFAULT_LOG_LEVEL,
    DEFAULT_MASTER_PORT,
    LOG_LEVELS,
    LaunchError,
)

AGENT_MODULE = "ds_launch.node"
# ``sh -c SOURCE_AND_EXEC SCRIPT PROGRAM...``: "$0" is the script, "$@" the rank's program.
SOURCE_AND_EXEC = '. "$0" && exec "$@"'


def sourced(script: str) -> str:
    """``script`` as ``.`` needs it: a bare name would be searched on ``PATH``, not here."""
    return script if "/" in script else f"./{script}"


def encode_world_info(resources: Mapping[str, Sequence[int]]) -> str:
    """``{host: slots}`` as URL-safe base64 JSON (DeepSpeed's ``--world_info`` encoding)."""
    data = json.dumps({host: list(slots) for host, slots in resources.items()})
    return base64.urlsafe_b64encode(data.encode()).decode()


def decode_world_info(text: str) -> dict[str, list[int]]:
    """Inverse of ``encode_world_info``.

    Raises:
        LaunchError: the text is not a base64 JSON object of host -> slot list.
    """
    try:
        data = json.loads(base64.urlsafe_b64decode(text.encode()))
        if not isinstance(data, dict) or not data:
            raise ValueError("expected a non-empty object")
        resources = {str(host): [int(s) for s in slots] for host, slots in data.items()}
    except (ValueError, TypeError) as exc:
        raise LaunchError(f"--world_info is not a ds-launch world info: {exc}") from None
    found = bad_host(resources)
    if found is not None:
        raise LaunchError(f"--world_info: host {found[0]!r} is refused: {found[1]}")
    return resources


@dataclass(frozen=True, kw_only=True)
class NodeSpec:
    """One node's share of a launch: everything ``ds_launch.node`` needs.

    Attributes:
        resources: ``{host: slots}`` of the whole job, in node order.
        node_rank: this node's index in ``resources``.
        master_addr: rank 0's address.
        master_port: rank 0's port.
        user_script: the program of every rank.
        user_args: its arguments.
        module: run it with ``python -m``.
        no_python: run it directly.
        no_local_rank: do not pass ``--local_rank=N``.
        save_pid: write this agent's pid to ``/tmp/<save_pid>.deepspeed`` (None: no file).
        enable_each_rank_log: directory for per-rank logs (None: none).
        bind_cores_to_rank: pin each rank to its share of ``bind_core_list`` or of all cores.
        bind_core_list: the cores to share out.
        gpus: slots are GPU ids (``CUDA_VISIBLE_DEVICES`` is set); False for CPU ranks.
        kill_grace: seconds between SIGTERM and SIGKILL.
        venv_script: a shell script each rank sources first (None: none).
        log_level: the agent's messages to print (``debug`` ... ``critical``).
        env: variables added to every rank's environment (only for the in-process agent;
            remote agents receive them through their command's ``env`` prefix).
        early_exit_grace: seconds the node's other ranks may run on after one exited 0 (None:
            allowed; see [Note: every member is seen]).
        report_events: write the ``up``/``exit`` lines the pdsh and ssh launchers watch.
    """

    resources: dict[str, list[int]]
    node_rank: int
    master_addr: str
    master_port: int
    user_script: str
    user_args: tuple[str, ...] = ()
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    save_pid: int | None = None
    enable_each_rank_log: str | None = None
    bind_cores_to_rank: bool = False
    bind_core_list: str | None = None
    gpus: bool = True
    kill_grace: float = DEFAULT_KILL_GRACE_S
    venv_script: str | None = None
    log_level: str = DEFAULT_LOG_LEVEL
    env: dict[str, str] = field(default_factory=dict)
    early_exit_grace: float | None = DEFAULT_EARLY_EXIT_GRACE_S
    report_events: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.node_rank < len(self.resources):
            raise LaunchError(
                f"node rank {self.node_rank} is out of range for {len(self.resources)} node(s)"
            )
        if self.module and self.no_python:
            raise LaunchError("--module runs `python -m`, --no_python runs no python: pick one")

    @property
    def host(self) -> str:
        return list(self.resources)[self.node_rank]

    @property
    def slots(self) -> list[int]:
        return self.resources[self.host]

    @property
    def world_size(self) -> int:
        return sum(len(slots) for slots in self.resources.values())

    @property
    def first_rank(self) -> int:
        """Global rank of this node's local rank 0."""
        return sum(len(slots) for slots in list(self.resources.values())[: self.node_rank])

    def rank_command(self, local_rank: int, python: str = sys.executable) -> list[str]:
        """The argv of one rank: ``python -u [-m] script [--local_rank=N] args``, run through
        ``sh -c '. SCRIPT && exec "$@"'`` with a ``venv_script``."""
        command = [] if self.no_python else [python, "-u", *(["-m"] if self.module else [])]
        command.append(self.user_script)
        if not self.no_local_rank:
            command.append(f"--local_rank={local_rank}")
        command += self.user_args
        if self.venv_script is not None:
            command = ["/bin/sh", "-c", SOURCE_AND_EXEC, sourced(self.venv_script), *command]
        return command

    def rank_env(self, local_rank: int) -> dict[str, str]:
        """Variables set for one rank (on top of the agent's environment and ``env``)."""
        local_size = str(len(self.slots))
        env = {
            "RANK": str(self.first_rank + local_rank),
            "LOCAL_RANK": str(local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": local_size,
            "LOCAL_SIZE": local_size,  # DeepSpeed's name for it
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "CROSS_RANK": str(self.node_rank),
            "CROSS_SIZE": str(len(self.resources)),
            "PYTHONUNBUFFERED": "1",
        }
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.slots))
        return env

    def to_argv(self, python: str = sys.executable, *, node: str | None = None) -> list[str]:
        """``python -u -m ds_launch.node ...``; ``node`` replaces ``--node_rank`` (e.g. pdsh's
        ``--node_host=%h``)."""
        argv = [
            python,
            "-u",
            "-m",
            AGENT_MODULE,
            f"--world_info={encode_world_info(self.resources)}",
        ]
        argv.append(node if node is not None else f"--node_rank={self.node_rank}")
        argv += [f"--master_addr={self.master_addr}", f"--master_port={self.master_port}"]
        flags = {
            "--module": self.module,
            "--no_python": self.no_python,
            "--no_local_rank": self.no_local_rank,
            "--bind_cores_to_rank": self.bind_cores_to_rank,
            "--cpu": not self.gpus,
        }
        argv += [flag for flag, on in flags.items() if on]
        if self.save_pid is not None:
            argv.append(f"--save_pid={self.save_pid}")
        if self.enable_each_rank_log is not None:
            argv.append(f"--enable_each_rank_log={self.enable_each_rank_log}")
        if self.bind_core_list is not None:
            argv.append(f"--bind_core_list={self.bind_core_list}")
        if self.kill_grace != DEFAULT_KILL_GRACE_S:
            argv.append(f"--kill_grace={self.kill_grace}")
        if self.venv_script is not None:
            argv.append(f"--venv_script={self.venv_script}")
        if self.log_level != DEFAULT_LOG_LEVEL:
            argv.append(f"--log_level={self.log_level}")
        if self.early_exit_grace is None:
            argv.append("--allow_early_rank_exit")
        elif self.early_exit_grace != DEFAULT_EARLY_EXIT_GRACE_S:
            argv.append(f"--early_exit_grace={self.early_exit_grace}")
        if self.report_events:
            argv.append("--report_events")
        return [*argv, self.user_script, *self.user_args]


def _agent_parser() -> argparse.ArgumentParser:
    """DeepSpeed's ``deepspeed.launcher.launch`` flags and defaults, plus ds-launch's own."""
    parser = argparse.ArgumentParser(
        prog="python -m ds_launch.node",
        description="ds-launch's per-node agent (DeepSpeed's deepspeed.launcher.launch): starts "
        "this node's ranks and supervises them.",
        allow_abbrev=False,
    )
    parser.add_argument("--world_info", default="None", help="base64 JSON {host: [slots]}")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--node_rank", type=int, default=None, help="this node's index (0)")
    where.add_argument("--node_host", help="this node's host name in world_info (pdsh's %%h)")
    parser.add_argument("--master_addr", default="127.0.0.1")
    parser.add_argument("--master_port", type=int, default=DEFAULT_MASTER_PORT)
    parser.add_argument("--module", action="store_true")
    parser.add_argument("--no_python", action="store_true")
    parser.add_argument("--no_local_rank", action="store_true")
    parser.add_argument("--save_pid", type=int, default=0, help="launcher pid (0: no pid file)")
    parser.add_argument("--enable_each_rank_log", default="None")
    parser.add_argument("--bind_cores_to_rank", action="store_true")
    parser.add_argument("--bind_core_list", default=None)
    parser.add_argument("--log_level", default=DEFAULT_LOG_LEVEL, choices=LOG_LEVELS)
    parser.add_argument("-q", "--quiet", action="store_true", help="--log_level error")
    parser.add_argument("--venv_script", default=None, help="shell script each rank sources")
    parser.add_argument("--cpu", action="store_true", help="slots are CPU ranks, not GPUs")
    parser.add_argument("--kill_grace", type=float, default=DEFAULT_KILL_GRACE_S)
    parser.add_argument("--allow_early_rank_exit", action="store_true")
    parser.add_argument("--early_exit_grace", type=float, default=DEFAULT_EARLY_EXIT_GRACE_S)
    parser.add_argument("--report_events", action="store_true", help="up/exit lines for ds-launch")
    # DeepSpeed's launch.py names for the user program and its arguments.
    parser.add_argument("training_script")
    parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return parser


def parse_node_args(argv: Sequence[str]) -> argparse.Namespace:
    """The agent's command line parsed, with DeepSpeed's ``launch.py`` attribute names.

    Raises:
        SystemExit: the arguments do not parse (argparse prints the usage).
    """
    return _agent_parser().parse_args(list(argv))


def parse_node_argv(argv: Sequence[str]) -> NodeSpec:
    """Read the agent's command line (what ``NodeSpec.to_argv`` wrote, minus the interpreter).

    Raises:
        LaunchError: the world info is malformed or does not list this node.
        SystemExit: the arguments do not parse (argparse prints the usage).
    """
    args = parse_node_args(argv)
    if args.world_info == "None":
        raise LaunchError("--world_info is required: the job's {host: [slots]} as base64 JSON")
    resources = decode_world_info(args.world_info)
    node_rank = 0 if args.node_rank is None else args.node_rank
    log_dir = args.enable_each_rank_log  # DeepSpeed's "no directory" is the string "None"
    if args.node_host is not None:
        if (problem := host_problem(args.node_host)) is not None:
            raise LaunchError(f"--node_host {args.node_host!r} is refused: {problem}")
        if args.node_host not in resources:
            raise LaunchError(
                f"--node_host {args.node_host!r} is not in the job's hosts ({', '.join(resources)})"
            )
        node_rank = list(resources).index(args.node_host)
    return NodeSpec(
        resources=resources,
        node_rank=node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        user_script=args.training_script,
        user_args=tuple(args.training_script_args),
        module=args.module,
        no_python=args.no_python,
        no_local_rank=args.no_local_rank,
        save_pid=args.save_pid or None,
        enable_each_rank_log=None if log_dir == "None" else log_dir,
        bind_cores_to_rank=args.bind_cores_to_rank,
        bind_core_list=args.bind_core_list,
        gpus=not args.cpu,
        kill_grace=args.kill_grace,
        venv_script=args.venv_script,
        log_level="error" if args.quiet else args.log_level,
        early_exit_grace=None if args.allow_early_rank_exit else args.early_exit_grace,
        report_events=args.report_events,
    )
