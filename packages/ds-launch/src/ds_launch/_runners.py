"""The real command line of each multi-node runner's tool.

[Note: two kinds of runner]
``pdsh`` and ``ssh`` start ds-launch's node agent once per node (``cd <launch dir> && exec env
K=V ... python -u -m ds_launch.node ...``); the agent then starts and supervises that node's
ranks, so every per-rank option works. ``openmpi``, ``mpich``, ``impi``, ``mvapich`` and
``slurm`` start every rank themselves, as DeepSpeed's runners do: ranks learn who they are from
the MPI launcher's or Slurm's variables (``OMPI_COMM_WORLD_*``, ``PMI_*``, ``SLURM_*``, which
``ds_comm.init_distributed`` reads), plus the ``MASTER_ADDR``/``MASTER_PORT`` ds-launch exports.
No ``RANK``/``WORLD_SIZE`` is exported there: a launcher variable that only some ranks could get
right would shadow the MPI ones. Options that need the agent (``--enable_each_rank_log``,
``--bind_cores_to_rank``, ``--save_pid``) are errors with these runners, and ``--local_rank`` is
never passed (no per-rank arguments exist in one ``mpirun`` command).

Devices: an agent sets each node's ``CUDA_VISIBLE_DEVICES`` from its slots. MPI ranks use
``LOCAL_RANK``-th visible GPU, which is right when every node uses slots ``0..n-1``; when the
selection picked other slots (``-i w1:2,3@w2:2,3``), the list must be the same on every node and
is exported as ``CUDA_VISIBLE_DEVICES``, else it is an error naming the nodes.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence

from ds_launch._names import bad_host, is_variable_name
from ds_launch._nodespec import NodeSpec
from ds_launch.api import AGENT_LAUNCHERS, LaunchConfig, LaunchError

PDSH_FAN_OUT = 1024
_HOST_PLACEHOLDER = "DSLAUNCHNODEHOST"
_PDSH_EXIT = re.compile(rb"^pdsh@[^:]*: (?P<host>.+?): \S+ exited with exit code (?P<code>\d+)")
# DeepSpeed's MVAPICH defaults; a value already in the environment wins.
_MVAPICH_DEFAULTS = {
    "MV2_SMP_USE_CMA": "0",
    "MV2_DEBUG_SHOW_BACKTRACE": "1",
    "MV2_SUPPORT_DL": "1",
    "MV2_ENABLE_AFFINITY": "0",
    "MV2_INTER_ALLGATHER_TUNING": "5",
    "MV2_CUDA_USE_NAIVE": "0",
}
TOOLS = {
    "pdsh": "pdsh",
    "ssh": "ssh",
    "openmpi": "mpirun",
    "mpich": "mpirun",
    "impi": "mpirun",
    "mvapich": "mpirun",
    "slurm": "srun",
}


def find_tool(name: str) -> str | None:
    """A tool on PATH, else next to the interpreter (pip's ``mpich`` wheel puts ``mpirun``
    there), else None."""
    found = shutil.which(name)
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), name)
    return beside if os.access(beside, os.X_OK) else None


def pdsh_failure(line: bytes) -> tuple[int, str] | None:
    """pdsh's ``pdsh@me: host: ssh exited with exit code N`` stderr line, as (N, description)."""
    match = _PDSH_EXIT.match(line)
    if match is None:
        return None
    host = match.group("host").decode(errors="replace")
    return int(match.group("code")), f"node {host} exited with code {int(match.group('code'))}"


def check_names(resources: Mapping[str, object], exports: Mapping[str, str]) -> None:
    """Every host a host name, every exported name a variable name, before any command is built
    (see [Note: names that cannot inject] in ``_names.py``).

    Raises:
        LaunchError: naming the host or variable and what is wrong with it.
    """
    found = bad_host(resources)
    if found is not None:
        raise LaunchError(f"host {found[0]!r} is refused: {found[1]}")
    for name in exports:
        if not is_variable_name(name):
            raise LaunchError(
                f"exported variable {name!r} is not a variable name (letters, digits and '_', "
                "not starting with a digit); fix it where it is set"
            )


def remote_command(spec: NodeSpec, exports: Mapping[str, str], cwd: str, node: str | None) -> str:
    """The shell command a node runs: ``cd DIR && exec env K=V ... python -m ds_launch.node``.

    Every word is quoted for the remote shell (``shlex.join``): values and user arguments reach
    the agent byte for byte. ``exec`` makes the agent the direct child of sshd, so it gets
    SIGTERM through its parent-death signal when the connection drops (see ``ds_launch.node``).
    """
    check_names(spec.resources, exports)
    words = ["env", *(f"{k}={v}" for k, v in exports.items())] if exports else []
    words += spec.to_argv(node=node)
    return f"cd {shlex.quote(cwd)} && exec {shlex.join(words)}"


def agent_node_command(spec: NodeSpec, exports: Mapping[str, str]) -> tuple[str, ...]:
    """The argv that runs on an agent node (for the plan): ``env K=V ... python -m ...``."""
    prefix = ("env", *(f"{k}={v}" for k, v in exports.items())) if exports else ()
    return (*prefix, *spec.to_argv())


def pdsh_command(
    config: LaunchConfig,
    spec: NodeSpec,
    exports: Mapping[str, str],
    cwd: str,
    environ: Mapping[str, str],
) -> tuple[list[str], dict[str, str]]:
    """pdsh's argv and the variables it needs (``PDSH_RCMD_TYPE``, ``PDSH_SSH_ARGS_APPEND``)."""
    remote = remote_command(spec, exports, cwd, f"--node_host={_HOST_PLACEHOLDER}")
    # pdsh expands %h (the node's name) and %% in the remote command. %h goes inside single
    # quotes: the names are checked host names already, and even a name that slipped through
    # would stay one word there (only a quote could end it, and no host name holds one).
    remote = remote.replace("%", "%%").replace(_HOST_PLACEHOLDER, "'%h'")
    argv = [find_tool("pdsh") or "pdsh", "-S", "-f", str(PDSH_FAN_OUT)]
    argv += ["-w", ",".join(spec.resources), *shlex.split(config.launcher_args), remote]
    tool_env = {"PDSH_RCMD_TYPE": environ.get("PDSH_RCMD_TYPE", "ssh")}
    if config.ssh_port is not None:
        append = environ.get("PDSH_SSH_ARGS_APPEND", "")
        tool_env["PDSH_SSH_ARGS_APPEND"] = f"{append} -p {config.ssh_port}".strip()
    return argv, tool_env


def ssh_commands(
    config: LaunchConfig, spec: NodeSpec, exports: Mapping[str, str], cwd: str
) -> list[list[str]]:
    """One ``ssh`` argv per node. ``--launcher_args`` come first: ssh keeps the first value it
    sees for an option, so the user's settings beat these defaults."""
    ssh = find_tool("ssh") or "ssh"
    port = ["-p", str(config.ssh_port)] if config.ssh_port is not None else []
    commands = []
    for node_rank, host in enumerate(spec.resources):
        remote = remote_command(spec, exports, cwd, f"--node_rank={node_rank}")
        options = [*shlex.split(config.launcher_args), "-T", "-o", "BatchMode=yes", *port]
        commands.append([ssh, *options, "--", host, remote])  # "--": the host is no option
    return commands


def _uniform_ranks_per_node(launcher: str, resources: Mapping[str, Sequence[int]]) -> int:
    counts = {host: len(slots) for host, slots in resources.items()}
    if len(set(counts.values())) != 1:
        listed = ", ".join(f"{host}: {n}" for host, n in counts.items())
        raise LaunchError(
            f"--launcher {launcher} starts the same number of ranks on every node, but the "
            f"selection has {listed}; adjust --include/--exclude or use --launcher openmpi, "
            "pdsh or ssh"
        )
    return next(iter(counts.values()))


def _device_exports(launcher: str, resources: Mapping[str, Sequence[int]], gpus: bool) -> dict:
    """``CUDA_VISIBLE_DEVICES`` for runners without an agent (see the module note)."""
    lists = {host: list(slots) for host, slots in resources.items()}
    if not gpus or all(slots == list(range(len(slots))) for slots in lists.values()):
        return {}
    if len({tuple(slots) for slots in lists.values()}) != 1:
        listed = "; ".join(f"{host}: {','.join(map(str, s))}" for host, s in lists.items())
        raise LaunchError(
            f"--launcher {launcher} cannot give each node its own GPU list ({listed}); select "
            "the same slots on every node, or use --launcher pdsh or ssh"
        )
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, next(iter(lists.values()))))}


def check_agent_options(config: LaunchConfig) -> None:
    """Options only the node agent implements are errors with MPI and Slurm runners."""
    if config.launcher in AGENT_LAUNCHERS:
        return
    used = [
        flag
        for flag, on in (
            ("--enable_each_rank_log", config.enable_each_rank_log is not None),
            ("--bind_cores_to_rank", config.bind_cores_to_rank),
            ("--save_pid", config.save_pid),
        )
        if on
    ]
    if used:
        raise LaunchError(
            f"{', '.join(used)} need(s) ds-launch's node agent, which --launcher "
            f"{config.launcher} does not use (it starts ranks itself); use --launcher pdsh or "
            "ssh, or the launcher's own options through --launcher_args"
        )


def mpi_command(
    config: LaunchConfig,
    spec: NodeSpec,
    exports: Mapping[str, str],
    hostfile_path: str,
    environ: Mapping[str, str],
) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """argv, tool variables and files for ``openmpi``, ``mpich``, ``impi``, ``mvapich`` and
    ``slurm``; every rank runs ``python -u [-m] script args``."""
    launcher, resources = config.launcher, spec.resources
    check_names(resources, exports)
    variables = dict(exports)
    if launcher == "mvapich":
        variables.update({k: v for k, v in _MVAPICH_DEFAULTS.items() if k not in environ})
        if spec.gpus:
            variables.setdefault("MV2_USE_CUDA", "1")
    variables.update(_device_exports(launcher, resources, spec.gpus))
    variables["MASTER_ADDR"] = spec.master_addr
    variables["MASTER_PORT"] = str(spec.master_port)
    program = spec.rank_command(0)  # spec.no_local_rank is set for these runners
    world = str(spec.world_size)
    extra = shlex.split(config.launcher_args)
    tool = find_tool(TOOLS[launcher]) or TOOLS[launcher]
    if launcher == "openmpi":
        argv = [tool, "-n", world, "--hostfile", hostfile_path, *extra]
        for name, value in variables.items():
            argv += ["-x", f"{name}={value}"]
        lines = "".join(f"{host} slots={len(slots)}\n" for host, slots in resources.items())
        return [*argv, *program], {}, {hostfile_path: lines}
    ppn = str(_uniform_ranks_per_node(launcher, resources))
    hosts = ",".join(resources)
    if launcher == "slurm":
        return _srun_command(tool, world, ppn, hosts, len(resources), extra, variables, program)
    argv = [tool, "-n", world, "-ppn", ppn, "-hosts", hosts, *extra]
    for name, value in variables.items():
        argv += ["-genv", name, value]
    return [*argv, *program], {}, {}


def _srun_command(
    tool: str,
    world: str,
    ppn: str,
    hosts: str,
    num_nodes: int,
    extra: list[str],
    variables: Mapping[str, str],
    program: list[str],
) -> tuple[list[str], dict[str, str], dict[str, str]]:
    # --export is comma-separated: a value holding a comma travels in srun's own environment
    # and is named without a value, which srun then propagates.
    inline = [f"{k}={v}" for k, v in variables.items() if "," not in v]
    by_name = {k: v for k, v in variables.items() if "," in v}
    export = ",".join(["ALL", *inline, *by_name])
    argv = [tool, "-n", world, f"--nodes={num_nodes}", f"--ntasks-per-node={ppn}"]
    argv += [f"--nodelist={hosts}", *extra, f"--export={export}"]
    return [*argv, *program], by_name, {}
