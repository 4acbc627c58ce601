"""The user program the launch tests start on every rank (not collected by pytest).

Usage: ``rank_program.py [--local_rank=N] MODE OUT_DIR TOKEN [key=value ...]``. ``TOKEN`` only
marks the command line so tests can find leftover processes in the process table.

Modes:
    report     write ``OUT_DIR/rank<R>.json`` with the launch environment, then exit 0.
    allreduce  the same after ``ds_comm.init_distributed()`` and an all_reduce of the rank.
    hang       write ``OUT_DIR/ready<R>``, start a grandchild that sleeps, and sleep; on SIGINT or
               SIGTERM write ``OUT_DIR/signal<R>`` and exit 1 (``ignore=<rank>``: that rank
               ignores both instead). ``crash=<rank>:<code>`` makes that rank exit with ``code``
               once every rank is ready; ``kill=<rank>`` makes it SIGKILL itself instead;
               ``exit0=<rank>`` makes it exit 0 then. ``finish=<seconds>``: the other ranks
               exit 0 after that long instead of sleeping.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# Variables the tests set or expect; the report holds those present.
WATCHED = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CROSS_RANK",
    "CROSS_SIZE",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
    "PMI_RANK",
    "PMI_SIZE",
    "OMPI_COMM_WORLD_RANK",
)


def _launcher_rank() -> int:
    for name in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        if name in os.environ:
            return int(os.environ[name])
    raise RuntimeError("no rank variable in the environment")


def _report(local_rank_args: list[str], args: list[str]) -> dict:
    return {
        "args": args,
        "env": {k: os.environ[k] for k in WATCHED if k in os.environ},
        "dstest": {k: v for k, v in os.environ.items() if "DSTEST" in k},
        "local_rank_args": local_rank_args,
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "cwd": os.getcwd(),
        "affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [],
        "pid_file": _pid_file(),
    }


def _pid_file() -> str | None:
    """``--save_pid``'s file for the local launcher, whose agent is the parent process."""
    path = Path(f"/tmp/{os.getppid()}.deepspeed")
    return path.read_text() if path.exists() else None


def _allreduce(out: dict) -> int:
    from datetime import timedelta

    import torch

    import ds_comm

    launch = ds_comm.init_distributed(
        auto_mpi_discovery=False, verbose=False, timeout=timedelta(seconds=90)
    )
    t = torch.tensor([float(launch.rank)])
    ds_comm.all_reduce(t)
    out["launch"] = [launch.rank, launch.world_size, launch.local_rank, launch.source]
    out["sum"] = t.item()
    ds_comm.destroy_process_group()
    return launch.rank


def _hang(out_dir: Path, rank: int, options: dict[str, str], token: str) -> None:
    def on_signal(signum: int, frame: object) -> None:
        (out_dir / f"signal{rank}").write_text(signal.Signals(signum).name)
        sys.exit(1)

    ignored = options.get("ignore") == str(rank)
    handler = signal.SIG_IGN if ignored else on_signal
    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
    sleeper = "import time; time.sleep(600)"
    subprocess.Popen([sys.executable, "-c", sleeper, token])  # a grandchild in the rank's group
    (out_dir / f"ready{rank}").write_text(str(os.getpid()))
    print(f"rank {rank} ready", flush=True)
    crash_rank, _, code = options.get("crash", "").partition(":")
    if crash_rank == str(rank) or options.get("kill") == str(rank):
        world = int(os.environ["WORLD_SIZE"])
        while len(list(out_dir.glob("ready*"))) < world:
            time.sleep(0.05)
        print(f"rank {rank} failing now", file=sys.stderr, flush=True)
        if options.get("kill") == str(rank):
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(int(code))
    if options.get("exit0") == str(rank):
        world = int(os.environ["WORLD_SIZE"])
        while len(list(out_dir.glob("ready*"))) < world:
            time.sleep(0.05)
        print(f"rank {rank} done early", flush=True)
        sys.exit(0)
    time.sleep(float(options.get("finish", 600)))


def main(argv: list[str]) -> None:
    local_rank_args = [a for a in argv if a.startswith("--local_rank")]
    mode, out_dir, token, *rest = [a for a in argv if not a.startswith("--local_rank")]
    options = dict(item.split("=", 1) for item in rest)
    out = Path(out_dir)
    if mode == "hang":
        _hang(out, _launcher_rank(), options, token)
        return
    result = _report(local_rank_args, rest)
    rank = _allreduce(result) if mode == "allreduce" else _launcher_rank()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    print(f"rank {rank} done")
    print(f"rank {rank} to stderr", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
