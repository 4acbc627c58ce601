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

``--ctrl-c`` measures instead how long a Ctrl-C takes to clear every process of a 2-rank job
(ranks, their children, the runner's tools, remote agents), for each runner installed here:
``local``, ``ssh`` and ``pdsh`` (through a throwaway sshd on a loopback port, two names of this
machine as the nodes), ``mpich``/``openmpi`` when ``mpirun`` is found, and ``torchrun`` as the
peer. SIGINT goes to the launcher's process group, as a terminal sends it. Ranks either keep
Python's default handlers (``cooperative``) or ignore SIGINT and SIGTERM (``stubborn``: a rank
stuck in a collective's C code runs no handler, so only SIGKILL stops it). Target: under 5 s.

Usage (from the workspace root)::

    uv run python tools/bench/launch.py                    # 2 and 4 ranks, 7 repeats
    uv run python tools/bench/launch.py --ranks 2 4 8 --repeats 11
    uv run python tools/bench/launch.py --user-code allreduce
    uv run python tools/bench/launch.py --ctrl-c --repeats 3
"""

from __future__ import annotations

import argparse
import os
import signal
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


# ---------------------------------------------------------------------------------------------
# --ctrl-c: Ctrl-C to every process gone, per runner


STOP_PROGRAM = """\
import os, signal, subprocess, sys, time
mode, out, token = sys.argv[-3:]
rank = next(os.environ[k] for k in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK") if k in os.environ)
if mode == "stubborn":  # a rank stuck in C code (a collective) runs no Python handler
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", token])
with open(os.path.join(out, "ready" + rank), "w") as fd:
    fd.write("1")
time.sleep(600)
"""
# What a terminal's Ctrl-C must achieve: every process of the job gone within this many seconds.
CTRL_C_TARGET_S = 5.0


def _processes_with(token: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if token.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                continue
    return found


class _Sshd:
    """A throwaway sshd on a loopback port (as the tests use), for the ssh and pdsh runners."""

    def __enter__(self) -> _Sshd:
        import shutil

        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        self.home = Path(tempfile.mkdtemp(prefix="ds-bench-sshd-"))
        for key in ("host_key", "user_key"):
            subprocess.run(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.home / key)],
                check=True,
            )
        authorized = self.home / "authorized_keys"
        authorized.write_text((self.home / "user_key.pub").read_text())
        authorized.chmod(0o600)
        self.port = _free_port()
        config = self.home / "sshd_config"
        config.write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {self.home / 'host_key'}\n"
            f"AuthorizedKeysFile {authorized}\nPidFile {self.home / 'sshd.pid'}\nUsePAM no\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nStrictModes no\n"
        )
        if os.geteuid() == 0:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        self.proc = subprocess.Popen(
            [sshd, "-D", "-e", "-f", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        self.options = (
            f"-i {self.home / 'user_key'} -o IdentitiesOnly=yes -o StrictHostKeyChecking=no "
            "-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o AddressFamily=inet"
        )
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def stop_commands(runner: str, port: int, hostfile: Path, sshd: _Sshd | None):
    """The launcher's argv and extra environment for a 2-rank job of ``runner``."""
    if runner == "torchrun":
        argv = [*_console_script("torchrun", "torch.distributed.run"), "--nproc_per_node=2"]
        return [*argv, f"--master_port={port}"], {}
    argv = [*_console_script("ds-launch", "ds_launch.cli"), f"--master_port={port}"]
    if runner == "local":
        return [*argv, "--num_gpus=2", "--no_local_rank"], {}
    if runner in ("ssh", "pdsh"):
        assert sshd is not None
        argv += [f"--hostfile={hostfile}", f"--launcher={runner}", f"--ssh_port={sshd.port}"]
        argv.append("--no_local_rank")
        if runner == "ssh":
            return [*argv, "--launcher_args", sshd.options], {}
        return argv, {"PDSH_SSH_ARGS_APPEND": sshd.options}
    return [*argv, f"--launcher={runner}", "--force_multi", "--num_gpus=2"], {}


def ctrl_c_once(command: list[str], extra_env: dict, program: Path, mode: str) -> float:
    """Seconds from SIGINT to the launcher's process group until no process of the job is left."""
    token = f"ds-bench-stop-{os.getpid()}-{time.monotonic_ns()}"
    with tempfile.TemporaryDirectory(prefix="ds-bench-stop-") as out:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", **extra_env}
        proc = subprocess.Popen(
            [*command, str(program), mode, out, token],
            env=env,
            cwd=out,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,  # the terminal's foreground group: Ctrl-C reaches all of it
        )
        deadline = time.monotonic() + 120
        while len(list(Path(out).glob("ready*"))) < 2:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise SystemExit(f"{' '.join(command)} did not start: {proc.stderr.read()!r}")
            time.sleep(0.02)
        time.sleep(0.5)
        start = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        while _processes_with(token) or proc.poll() is None:
            if time.monotonic() - start > 60:
                for pid in _processes_with(token):
                    os.kill(pid, signal.SIGKILL)
                return float("inf")
            time.sleep(0.01)
        elapsed = time.monotonic() - start
        proc.wait()
        proc.stderr.close()
    return elapsed


# The MPI a runner needs, as ``mpirun --version`` names it.
_MPI_FLAVOURS = {"openmpi": "Open MPI", "mpich": "HYDRA", "impi": "Intel", "mvapich": "MVAPICH"}


def _missing_tool(runner: str, tool: str | None, find_tool) -> str | None:
    """Why ``runner`` cannot run here (its tool is absent, or another MPI's), or None."""
    if tool is None or runner in ("ssh", "pdsh"):
        return None
    path = find_tool(tool)
    if path is None:
        return f"{tool} is not installed here"
    flavour = _MPI_FLAVOURS.get(runner)
    if flavour is not None:
        version = subprocess.run([path, "--version"], capture_output=True, text=True).stdout
        if flavour.lower() not in version.lower():
            return f"{path} is not {flavour}'s mpirun"
    return None


def measure_ctrl_c(runners: list[str], repeats: int) -> dict[str, dict[str, list[float]]]:
    """Per runner, per rank behaviour (``cooperative``, ``stubborn``): the stop times."""
    from ds_launch._runners import TOOLS, find_tool

    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="ds-bench-program-") as folder, _Sshd() as sshd:
        program = Path(folder) / "stop_program.py"
        program.write_text(STOP_PROGRAM)
        hostfile = Path(folder) / "hostfile"
        hostfile.write_text("127.0.0.1 slots=1\nlocalhost slots=1\n")
        for runner in runners:
            missing = _missing_tool(runner, TOOLS.get(runner), find_tool)
            if missing:
                print(f"{runner}: {missing}; not measured")
                continue
            results[runner] = {}
            for mode in ("cooperative", "stubborn"):
                times = []
                for _ in range(repeats):
                    command, extra = stop_commands(runner, _free_port(), hostfile, sshd)
                    times.append(ctrl_c_once(command, extra, program, mode))
                results[runner][mode] = times
    return results


def print_ctrl_c_table(results: dict[str, dict[str, list[float]]]) -> bool:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\nCtrl-C to every process gone, 2 ranks; {os.cpu_count()} cores, load {load:.1f}")
    print("seconds, median (max) over the repeats; 'stubborn' ranks ignore SIGINT and SIGTERM\n")
    print(f"{'runner':<10} {'cooperative':>16}  {'stubborn':>16}  target < {CTRL_C_TARGET_S:g} s")
    met_all = True
    for runner, modes in results.items():
        cells = [f"{statistics.median(t):7.2f} ({max(t):6.2f})" for t in modes.values()]
        worst = max(max(t) for t in modes.values())
        met = worst < CTRL_C_TARGET_S or runner == "torchrun"  # the peer is not held to it
        met_all &= met
        verdict = "peer" if runner == "torchrun" else ("met" if met else "NOT met")
        print(f"{runner:<10} {cells[0]:>16}  {cells[1]:>16}  {verdict}")
    return met_all


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--user-code", choices=["empty", "allreduce"], default="empty")
    parser.add_argument("--ctrl-c", action="store_true", help="time Ctrl-C to a clean table")
    parser.add_argument(
        "--runners", nargs="+", default=["local", "ssh", "pdsh", "mpich", "openmpi", "torchrun"]
    )
    args = parser.parse_args()
    if args.ctrl_c:
        met = print_ctrl_c_table(measure_ctrl_c(args.runners, min(args.repeats, 5)))
        print("\nall targets met" if met else "\nsome targets NOT met")
        return
    with tempfile.TemporaryDirectory(prefix="ds-bench-program-") as folder:
        program = Path(folder) / "user_program.py"
        program.write_text(USER_PROGRAM)
        results = {n: measure(n, args.repeats, program, args.user_code) for n in args.ranks}
    met = print_table(results, args.user_code)
    print("\nall targets met" if met else "\nsome targets NOT met")


if __name__ == "__main__":
    main()
