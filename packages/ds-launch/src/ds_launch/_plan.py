"""From options to a plan: the resource pool, the selection, the runner and its commands."""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, replace

from ds_launch import _runners
from ds_launch._devices import visible_gpu_ids
from ds_launch._exports import collect_exports, env_files, without_launch_vars
from ds_launch._hostfile import parse_hostfile
from ds_launch._members import WatchPolicy
from ds_launch._nodespec import NodeSpec
from ds_launch._resources import select_resources
from ds_launch._supervise import ChildSpec
from ds_launch.api import (
    AGENT_LAUNCHERS,
    DEFAULT_HOSTFILE,
    LaunchConfig,
    LaunchError,
    LaunchPlan,
    NodePlan,
    RankPlan,
)

LOCAL_HOST = "localhost"
LOCAL_ADDR = "127.0.0.1"


@dataclass(frozen=True)
class _Pool:
    slots: dict[str, list[int]]
    gpus: bool
    name: str
    hostfile: str | None
    hint: str | None = None


@dataclass(frozen=True)
class Built:
    """A plan plus what executing it takes: the in-process agent's spec (local launcher) or
    the tool processes to supervise (every other runner)."""

    plan: LaunchPlan
    local_node: NodeSpec | None
    tools: tuple[ChildSpec, ...]
    hint: str | None
    env_files: tuple[str, ...] = ()
    watch: WatchPolicy | None = None


def _pool(config: LaunchConfig, environ: Mapping[str, str], default_hostfile: str) -> _Pool:
    hostfile = config.hostfile
    if hostfile is None and os.path.isfile(default_hostfile):
        hostfile = default_hostfile
    if hostfile is not None:
        counts = parse_hostfile(hostfile)
        slots = {host: list(range(n)) for host, n in counts.items()}
        return _Pool(slots, True, f"hostfile {hostfile}", hostfile)
    try:
        gpu_ids = visible_gpu_ids(environ)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    if gpu_ids:
        visible = environ.get("CUDA_VISIBLE_DEVICES")
        where = f"CUDA_VISIBLE_DEVICES={visible}" if visible is not None else "visible GPUs"
        return _Pool({LOCAL_HOST: gpu_ids}, True, f"this machine ({where})", None)
    count = config.num_gpus if config.num_gpus > 0 else 1
    hint = None
    if config.num_gpus < 1 and not (config.include or config.exclude):
        hint = "no GPU found: starting 1 CPU rank (pass --num_gpus N for N CPU ranks)"
    return _Pool({LOCAL_HOST: list(range(count))}, False, "this machine (CPU ranks)", None, hint)


def _layout(
    spec: NodeSpec, exports: Mapping[str, str], program: tuple[str, ...] | None = None
) -> tuple[NodePlan, ...]:
    """Every node and rank with its command: the agent (with the exports) on each node, or,
    for MPI and Slurm runners, ``program`` on every rank."""
    nodes = []
    for node_rank, (host, slots) in enumerate(spec.resources.items()):
        node = replace(spec, node_rank=node_rank)
        ranks = tuple(
            RankPlan(
                rank=node.first_rank + local_rank,
                local_rank=local_rank,
                node_rank=node_rank,
                host=host,
                slot=slot,
                command=program or tuple(node.rank_command(local_rank)),
            )
            for local_rank, slot in enumerate(slots)
        )
        command = program or _runners.agent_node_command(node, exports)
        nodes.append(
            NodePlan(
                host=host, node_rank=node_rank, slots=tuple(slots), command=command, ranks=ranks
            )
        )
    return tuple(nodes)


def _job(config: LaunchConfig, pool: _Pool, pid: int) -> tuple[NodeSpec, str]:
    """The job's layout as the spec of the node started first (node 0, or ``--node_rank`` with
    ``--no_ssh``), and the runner that will start it."""
    resources = select_resources(
        pool.slots,
        include=config.include,
        exclude=config.exclude,
        num_nodes=config.num_nodes,
        num_gpus=config.num_gpus,
        pool_name=pool.name,
    )
    multi = not config.no_ssh and (config.force_multi or len(resources) > 1)
    if config.launcher == "local" and multi:
        raise LaunchError(
            f"--launcher local runs on this machine only, but the job spans {len(resources)} "
            f"node(s) ({', '.join(resources)}){' with --force_multi' if config.force_multi else ''}"
            "; pick a multi-node launcher or select one node (--num_nodes 1, --include), or "
            "start each node yourself with --no_ssh --node_rank N"
        )
    if config.no_ssh and config.node_rank >= len(resources):
        raise LaunchError(
            f"--node_rank {config.node_rank}: the job has {len(resources)} node(s) "
            f"({', '.join(resources)}); pass 0..{len(resources) - 1}"
        )
    launcher = config.launcher if multi else "local"
    if launcher != "local":
        _runners.check_agent_options(config)
    # Every rank is on this machine without a hostfile, or when one node runs alone.
    on_this_machine = pool.hostfile is None or (len(resources) == 1 and not multi)
    master_addr = config.master_addr or (LOCAL_ADDR if on_this_machine else next(iter(resources)))
    spec = NodeSpec(
        resources=resources,
        node_rank=config.node_rank if config.no_ssh else 0,
        master_addr=master_addr,
        master_port=config.master_port,
        user_script=config.user_script,
        user_args=config.user_args,
        module=config.module,
        no_python=config.no_python,
        no_local_rank=config.no_local_rank or launcher not in AGENT_LAUNCHERS,
        save_pid=pid if config.save_pid else None,
        enable_each_rank_log=config.enable_each_rank_log,
        bind_cores_to_rank=config.bind_cores_to_rank,
        bind_core_list=config.bind_core_list,
        gpus=pool.gpus,
        kill_grace=config.kill_grace,
        venv_script=config.venv_script,
        log_level=config.log_level,
        early_exit_grace=None if config.allow_early_rank_exit else config.early_exit_grace,
        report_events=launcher in ("pdsh", "ssh"),
    )
    return spec, launcher


def _check_venv_script(config: LaunchConfig, cwd: str) -> None:
    """A local launch can check ``--venv_script`` exists (remote nodes check for themselves)."""
    if config.venv_script is None:
        return
    path = os.path.join(cwd, config.venv_script)
    if not os.path.isfile(path):
        raise LaunchError(
            f"--venv_script {config.venv_script}: no such file (looked at {path}); pass the "
            "activation script's path, e.g. /path/to/venv/bin/activate"
        )


def build(
    config: LaunchConfig,
    environ: Mapping[str, str],
    *,
    cwd: str,
    home: str,
    pid: int,
    default_hostfile: str = DEFAULT_HOSTFILE,
) -> Built:
    """Resolve everything a launch does; see ``plan_launch``.

    Raises:
        LaunchError: any inconsistency, naming the flag, the value and the fix.
    """
    pool = _pool(config, environ, default_hostfile)
    spec, launcher = _job(config, pool, pid)
    exports = collect_exports(environ, cwd=cwd, home=home, multi_node=launcher != "local")
    read = tuple(env_files(environ, cwd, home))
    common = {
        "launcher": launcher,
        "world_size": spec.world_size,
        "master_addr": spec.master_addr,
        "master_port": spec.master_port,
        "exports": exports,
    }
    if launcher == "local":
        _check_venv_script(config, cwd)
        nodes = _layout(spec, exports)
        plan = LaunchPlan(commands=(nodes[spec.node_rank].command,), nodes=nodes, **common)
        return Built(plan, replace(spec, env=exports), (), pool.hint, read)
    files: dict[str, str] = {}
    if launcher == "pdsh":
        argv, tool_env = _runners.pdsh_command(config, spec, exports, cwd, environ)
        commands, nodes = [argv], _layout(spec, exports)
    elif launcher == "ssh":
        commands, tool_env = _runners.ssh_commands(config, spec, exports, cwd), {}
        nodes = _layout(spec, exports)
    else:
        hostfile = os.path.join(tempfile.gettempdir(), f"ds-launch-{pid}.hostfile")
        argv, tool_env, files = _runners.mpi_command(config, spec, exports, hostfile, environ)
        commands, nodes = [argv], _layout(spec, exports, tuple(spec.rank_command(0)))
    plan = LaunchPlan(
        commands=tuple(map(tuple, commands)),
        tool_env=tool_env,
        files=files,
        nodes=nodes,
        **common,
    )
    env = {**without_launch_vars(environ), **tool_env}
    tools = _tool_children(launcher, commands, env, spec)
    return Built(plan, None, tools, pool.hint, read, _node_watch(config, launcher, spec))


def _node_watch(config: LaunchConfig, launcher: str, spec: NodeSpec) -> WatchPolicy | None:
    """The nodes as the members of a pdsh or ssh launch (see [Note: every member is seen])."""
    if launcher not in ("pdsh", "ssh"):
        return None  # MPI and Slurm launchers start and watch their ranks themselves
    return WatchPolicy(
        names=tuple(f"node {i} ({host})" for i, host in enumerate(spec.resources)),
        start_timeout=config.node_start_timeout,
        early_exit_grace=None if config.allow_early_rank_exit else config.early_exit_grace,
    )


def _tool_children(
    launcher: str, commands: list[list[str]], env: dict[str, str], spec: NodeSpec
) -> tuple[ChildSpec, ...]:
    hosts = list(spec.resources)
    every_node = tuple(range(len(hosts)))
    children = []
    for index, argv in enumerate(commands):
        name = f"node {index} ({hosts[index]})" if launcher == "ssh" else os.path.basename(argv[0])
        children.append(
            ChildSpec(
                name=name,
                argv=argv,
                env=env,
                # ssh, mpirun and srun tear their side down on SIGTERM; a SIGTERMed pdsh leaves
                # its ssh processes behind, so it is left to the reaper (see _supervise.py).
                death_signal=None if launcher == "pdsh" else signal.SIGTERM,
                stop_signal=signal.SIGKILL if launcher == "pdsh" else None,
                failure_line=_runners.pdsh_failure if launcher == "pdsh" else None,
                # pdsh carries every node, ssh one each; both agents report their events.
                members=every_node if launcher == "pdsh" else None,
                events=launcher in ("pdsh", "ssh"),
            )
        )
    return tuple(children)


def plan_launch(
    config: LaunchConfig, environ: Mapping[str, str] | None = None, *, cwd: str | None = None
) -> LaunchPlan:
    """Everything a launch would do, without running anything (what ``--dry_run`` prints).

    Args:
        config: the launch options.
        environ: the launcher's environment (default ``os.environ``).
        cwd: the launch directory (default the current one).

    Raises:
        LaunchError: a bad hostfile, selection or option combination; the message says which
            flag or file, the value, and the fix.

    Example:
        >>> plan = plan_launch(LaunchConfig(user_script="train.py", hostfile="hosts"))
        >>> plan.launcher, plan.world_size, plan.nodes[1].host
        ('pdsh', 8, 'worker-2')
    """
    environ = os.environ if environ is None else environ
    built = build(
        config,
        environ,
        cwd=cwd or os.getcwd(),
        home=os.path.expanduser("~"),
        pid=os.getpid(),
    )
    return built.plan
