"""The node agent: start this node's ranks, supervise them, report the first failure."""

from __future__ import annotations

import os
import shlex
import sys
import time

from ds_launch._devices import parse_core_list, rank_core_shares, usable_cores
from ds_launch._log import Console
from ds_launch._members import WatchPolicy, event_line
from ds_launch._nodespec import NodeSpec
from ds_launch._supervise import ChildSpec, report_failure, supervise
from ds_launch.api import LaunchError

PID_FILE_DIR = "/tmp"  # DeepSpeed's location for --save_pid files


def _core_shares(spec: NodeSpec) -> list[list[int]] | None:
    if not spec.bind_cores_to_rank:
        return None
    cores = parse_core_list(spec.bind_core_list) if spec.bind_core_list else usable_cores()
    try:
        return rank_core_shares(cores, len(spec.slots))
    except ValueError as exc:
        raise LaunchError(f"--bind_cores_to_rank on {spec.host}: {exc}") from None


def _log_paths(spec: NodeSpec) -> list[str | None]:
    if spec.enable_each_rank_log is None:
        return [None] * len(spec.slots)
    try:
        os.makedirs(spec.enable_each_rank_log, exist_ok=True)
    except OSError as exc:
        raise LaunchError(f"--enable_each_rank_log {spec.enable_each_rank_log}: {exc}") from None
    stamp = time.strftime("%Y%m%d%H%M%S")  # DeepSpeed's names: <time>_rank<N>.log
    return [
        os.path.join(spec.enable_each_rank_log, f"{stamp}_rank{spec.first_rank + i}.log")
        for i in range(len(spec.slots))
    ]


def rank_children(spec: NodeSpec) -> list[ChildSpec]:
    """One ``ChildSpec`` per local rank: argv, full environment, prefix, log file, cores."""
    shares = _core_shares(spec)
    logs = _log_paths(spec)
    base = {**os.environ, **spec.env}
    children = []
    for local_rank in range(len(spec.slots)):
        rank = spec.first_rank + local_rank
        env = {**base, **spec.rank_env(local_rank)}
        cores = shares[local_rank] if shares else None
        if cores:
            env["OMP_NUM_THREADS"] = str(len(cores))
        children.append(
            ChildSpec(
                name=f"rank {rank} on {spec.host}",
                argv=spec.rank_command(local_rank),
                env=env,
                prefix=f"[rank{rank}] ".encode(),
                log_path=logs[local_rank],
                cores=cores,
            )
        )
    return children


def _write_pid_file(launcher_pid: int | None) -> str | None:
    if launcher_pid is None:
        return None
    path = os.path.join(PID_FILE_DIR, f"{launcher_pid}.deepspeed")
    try:
        with open(path, "x", encoding="utf-8") as fd:
            fd.write(str(os.getpid()))
    except FileExistsError:
        raise LaunchError(
            f"--save_pid: {path} already exists (left by another launch?); remove it"
        ) from None
    return path


def run_node(spec: NodeSpec) -> int:
    """Start this node's ranks and wait for them; the exit code of the node.

    Every rank gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``, ``CROSS_RANK``, ``CROSS_SIZE`` (and
    ``CUDA_VISIBLE_DEVICES`` for GPU slots); its output lines reach the console prefixed with
    ``[rankN]``. When a rank fails the others are stopped and the failing rank's last lines are
    printed; the node exits with that rank's code (128 + N after signal N).

    Raises:
        LaunchError: the ranks cannot be started (bad core list, log directory, pid file...).
    """
    console = Console(spec.log_level)
    children = rank_children(spec)
    first = spec.first_rank
    console.info(
        f"node {spec.node_rank} ({spec.host}) of {len(spec.resources)}: starting rank(s) "
        f"{first}..{first + len(children) - 1} of {spec.world_size} on slot(s) "
        f"{','.join(map(str, spec.slots))}"
    )
    for local_rank, child in enumerate(children):
        variables = " ".join(f"{k}={v}" for k, v in spec.rank_env(local_rank).items())
        console.debug(f"{child.name}: {variables} {shlex.join(child.argv)}")
    pid_file = _write_pid_file(spec.save_pid)
    watch = WatchPolicy(
        names=tuple(child.name for child in children), early_exit_grace=spec.early_exit_grace
    )
    try:
        outcome = supervise(
            children,
            kill_grace=spec.kill_grace,
            noun="rank",
            console=console,
            watch=watch,
            on_started=lambda: _report_event(spec, "up", 0),
        )
    finally:
        if pid_file is not None:
            os.unlink(pid_file)
    report_failure(outcome, with_tail=True, console=console)
    _report_event(spec, "exit", outcome.exit_code)
    return outcome.exit_code


def _report_event(spec: NodeSpec, kind: str, code: int) -> None:
    """One line for the launcher watching this node (see [Note: every member is seen])."""
    if spec.report_events:
        sys.stderr.write(event_line(kind, spec.node_rank, code) + "\n")
        sys.stderr.flush()
