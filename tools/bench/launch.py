"""Launch overhead: ds-launch next to ``torchrun --nproc_per_node``, measured in the same run.

For 2 and 4 local ranks, times the wall clock from starting the launcher command to every rank
being inside user code, and to the launcher's exit once every rank has returned. The user
program is the same for both launchers and does nothing but record when it starts (so the
numbers are the launchers' own cost); ``--user-code allreduce`` makes it initialise a gloo
group and all_reduce once instead (the realistic case, dominated by ``import torch``).

Both launchers get ``CUDA_VISIBLE_DEVICES=""`` (CPU ranks: ds-launch's ``--num_gpus N``,
torchrun's ``--nproc_per_node N``), a free ``--master_port``, and the same environment. Runs
alternate between the two (and which goes first) so that drift in machine load hits both; one
untimed warm-up of each fills the file cache. The table shows medians (and minimums) over
``--repeats`` runs.

Target: ds-launch <= torchrun in total time, for every rank count.

Usage (from the workspace root)::

    uv run python tools/bench/launch.py                    # 2 and 4 ranks, 7 repeats
    uv run python tools/bench/launch.py --ranks 2 4 8 --repeats 11
    uv run python tools/bench/launch.py --user-code allreduce
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Written into the temporary directory and run by every rank. Only `os`, `sys` and `time` are
# imported before the entry time is taken.
USER_PROGRAM = """\
import os, sys, time
entered = time.time()
out = sys.argv[-1]
rank = os.environ["RANK"]
if sys.argv[-2] == "allreduce":
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    dist.destroy_process_group()
with open(os.path.join(out, "enter" + rank), "w") as fd:
    fd.write(repr(entered))
"""


@dataclass(frozen=True)
class Sample:
    """One launch: seconds from the command to the last rank entering user code, and to exit."""

    to_user_code: float
    total: float


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _console_script(name: str, module: str) -> list[str]:
    beside = Path(sys.executable).with_name(name)
    return [str(beside)] if beside.exists() else [sys.executable, "-m", module]


def launcher_commands(ranks: int, port: int) -> dict[str, list[str]]:
    """The two launchers' commands (before the user program) for ``ranks`` local CPU ranks."""
    return {
        "ds-launch": [
            *_console_script("ds-launch", "ds_launch.cli"),
            f"--num_gpus={ranks}",
            f"--master_port={port}",
            "--no_local_rank",
        ],
        "torchrun": [
            *_console_script("torchrun", "torch.distributed.run"),
            f"--nproc_per_node={ranks}",
            f"--master_port={port}",
        ],
    }


def run_once(command: list[str], program: Path, ranks: int, user_code: str) -> Sample:
    """Launch once and time it; fails loudly if the launch failed or a rank did not run."""
    with tempfile.TemporaryDirectory(prefix="ds-bench-launch-") as out:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
        full = [*command, str(program), user_code, out]
        start = time.time()
        proc = subprocess.run(full, env=env, capture_output=True, text=True, timeout=600)
        end = time.time()
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(full)} failed ({proc.returncode}):\n{proc.stderr}")
        entries = [float(p.read_text()) for p in Path(out).glob("enter*")]
        if len(entries) != ranks:
            raise SystemExit(f"{' '.join(full)}: {len(entries)} of {ranks} ranks ran")
    return Sample(max(entries) - start, end - start)


def measure(ranks: int, repeats: int, program: Path, user_code: str) -> dict[str, list[Sample]]:
    samples: dict[str, list[Sample]] = {"ds-launch": [], "torchrun": []}
    for warm_up in launcher_commands(ranks, _free_port()).values():
        run_once(warm_up, program, ranks, user_code)
    for index in range(repeats):
        commands = list(launcher_commands(ranks, _free_port()).items())
        for name, command in commands if index % 2 == 0 else reversed(commands):
            samples[name].append(run_once(command, program, ranks, user_code))
    return samples


def _median_min(values: list[float]) -> str:
    return f"{statistics.median(values):7.3f} ({min(values):6.3f})"


def print_table(results: dict[int, dict[str, list[Sample]]], user_code: str) -> bool:
    """Print the table and the target checks; True when every target is met."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nlaunch overhead, user code: {user_code}; {os.cpu_count()} cores, load {load:.1f}")
    print("seconds, median (min) over the repeats\n")
    print(f"{'ranks':>5}  {'launcher':<10} {'to user code':>16}  {'total':>16}")
    met_all = True
    for ranks, samples in results.items():
        for name, runs in samples.items():
            entry = _median_min([s.to_user_code for s in runs])
            total = _median_min([s.total for s in runs])
            print(f"{ranks:>5}  {name:<10} {entry:>16}  {total:>16}")
        ours = statistics.median(s.total for s in samples["ds-launch"])
        peer = statistics.median(s.total for s in samples["torchrun"])
        met = ours <= peer
        met_all &= met
        verdict = "met" if met else "NOT met"
        print(f"{'':>5}  target ds-launch <= torchrun: {ours:.3f} vs {peer:.3f} s -> {verdict}")
    return met_all


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--user-code", choices=["empty", "allreduce"], default="empty")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ds-bench-program-") as folder:
        program = Path(folder) / "user_program.py"
        program.write_text(USER_PROGRAM)
        results = {n: measure(n, args.repeats, program, args.user_code) for n in args.ranks}
    met = print_table(results, args.user_code)
    print("\nall targets met" if met else "\nsome targets NOT met")


if __name__ == "__main__":
    main()
