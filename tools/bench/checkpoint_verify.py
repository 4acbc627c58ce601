"""What checkpoint verification costs: ``load_checkpoint`` with and without the integrity check.

For each setting (ZeRO-2 and ZeRO-3; a full load, and a weights-only load,
``load_optimizer_states=False``) one process saves an engine (a stack of ``--width`` x
``--width`` linear layers, Adam, ``--params`` million parameters) once, then loads that same
checkpoint ``--rounds`` times each way, the two arms alternating which goes first:

* ``with verify``: ``engine.load_checkpoint`` as shipped: ``ds_manifest.json`` read and its
  seal checked, every file the load reads checked against it (from the loader's own tensors
  as it reads them, see ds-zero's [Note: verifying what the loader read]; the files it does
  not read hashed on threads), the zero manifest's seal, bindings and coverage checked, the
  verdict agreed, then the values written;
* ``without verify``: the same load with the checks replaced by no-ops. The loader then reads
  the model file's tensors into memory (``torch.load``); with ``--mapped-baseline`` it maps the
  file and uses the tensors in place, as it does under the check (which copies them out as it
  hashes them, see ds-zero's [Note: copying the file the loader reads whole]): the fastest
  unchecked read, against which the check's hashing and copying are all cost.

The table gives, per setting, the median wall time of each arm, the overhead (with / without
- 1; the target is under 5%), the paired overhead (the median over rounds of each round's
with / without - 1, with its quartiles: on a machine whose speed drifts, as shared VMs' memory
bandwidth does, the two loads of one round saw the same machine), and the same for the
process's CPU time (all threads): on a
busy machine, where no core is free for the checksum threads, the CPU overhead is what the
wall overhead tends to. One load of each arm first warms the page cache, so by default both
arms load from memory (the worst case for the overhead). ``--cold`` drops the checkpoint's
pages from the page cache before every timed load (``posix_fadvise(DONTNEED)`` on each file,
no root needed), so both arms read from the disk, as a job does when it starts.

Usage (from the workspace root)::

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/checkpoint_verify.py --params 10 --rounds 5
    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/checkpoint_verify.py --params 10 --rounds 5 --cold
    ... --stage 3 --no-optimizer-states --phases   # one setting, with each load phase timed
    ... --stage 3 --no-optimizer-states --processes 6   # the median over 6 fresh processes
    ... --stage 3 --no-optimizer-states --first-loads 10   # a fresh process's one load
    ... --stage 2 --processes 20 --mapped-baseline   # against the fastest unchecked read

A process's speed can differ from the next one's by more than the checks cost (on the shared
development VM the same unverified load takes 30 ms in one process and 40 ms in the next), so
``--processes N`` runs the whole measurement in N fresh processes, one after another, and gives
the median over them of each figure, with each process's paired overhead, and a 95% confidence
interval for the median of the paired overhead over processes (distribution-free, see
``_shared/median_interval.py``; 6 processes or more), which says whether the 5% target is met,
missed or not settled by that many processes.

``--first-loads N`` times instead what a job pays once, at its start: the first load of a fresh
process (nothing allocated or mapped before it, the page cache warm), in N processes per arm,
the arms alternating; the overhead of each pair of processes (one of each arm, one after the
other) gives the median and its 95% interval. Each process's load is also printed (stderr), and
``--phases`` gives the median over each arm's processes of each phase.

``--phases``, and each process's line under ``--processes``, also give the median count of
minor page faults a load takes in each arm (the whole process's): a load that writes into
memory the process never wrote before faults in each page, which can cost as much as the copy
(ds-zero's [Note: copying while verifying]).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from _shared.median_interval import (  # tools/bench/_shared (this script's folder is on sys.path)
    against_target,
    median_interval,
)

TARGET = 0.05  # issue 24: verification costs under 5% of load time


def _engine(params_m: float, width: int, stage: int):
    import torch  # here, not at the top: a refused option is told without importing torch

    import ds_engine

    layers = max(1, round(params_m * 1e6 / (width * width)))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "steps_per_print": 10**9,
    }
    engine, *_ = ds_engine.initialize(model=model, config=config)
    return engine


class _NoCheck:
    """A pending verification that checks nothing (what loading cost before the checks).
    ``mapped``: the loader maps the model file and uses its tensors in place, as it does when
    the check copies them (``--mapped-baseline``); otherwise it reads them into memory."""

    manifest: dict = {}

    def __init__(self, mapped: bool = False) -> None:
        self.mapped = mapped

    def note(self, problem: str) -> None:
        raise RuntimeError(problem)

    def hash_loaded(self, path: object, obj: object) -> None:
        pass

    def copying(self, path: object) -> bool:
        return self.mapped

    def copying_into(self, path: object) -> bool:
        return False  # the unchecked load reads the weights into the model, then the masters

    def verified_object(self, path: object, obj: object) -> object:
        return obj

    def skip(self, folder: str) -> None:
        pass

    def wait(self, problems=()) -> dict:
        return {}

    def close(self) -> None:
        pass

    def __enter__(self) -> _NoCheck:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


@contextlib.contextmanager
def _unverified(mapped: bool = False) -> Iterator[None]:
    """Loading with the integrity checks made no-ops (``mapped``: see :class:`_NoCheck`)."""
    import ds_engine._checkpoint as engine_ckpt
    import ds_zero._checkpoint as zero_ckpt
    import ds_zero._consolidate as zero_consolidate

    saved = (
        engine_ckpt.start_verification,
        zero_ckpt.binding_problems,
        zero_consolidate.verify_directory,
    )
    engine_ckpt.start_verification = lambda *a, **k: _NoCheck(mapped)
    zero_ckpt.binding_problems = lambda *a, **k: []
    zero_consolidate.verify_directory = lambda *a, **k: {}
    try:
        yield
    finally:
        (
            engine_ckpt.start_verification,
            zero_ckpt.binding_problems,
            zero_consolidate.verify_directory,
        ) = saved


# (module, attribute) of each load phase timed by --phases; start_verification (of which the
# manifest's reading), the wait, the swap of the model file's tensors for their checked copies
# and the close are the verification's own, the others run in both arms (the module's weights
# set from the state dict, and a ZeRO-1/2 optimizer's masters rebuilt from them, all of them
# unless the check copied the weights into the masters).
_PHASES = (
    ("ds_engine._checkpoint", "start_verification"),
    ("ds_zero._integrity", "read_directory_manifest"),
    ("ds_engine._checkpoint", "_read_model_file"),
    ("ds_zero._checkpoint", "verify_checkpoint"),
    ("ds_zero._zero_shards", "_read_shards"),
    ("ds_zero._integrity", "PendingVerification.wait"),
    ("ds_zero._integrity", "PendingVerification.verified_object"),
    ("ds_zero._integrity", "PendingVerification.close"),
    ("ds_engine._checkpoint", "_load_module"),
    ("ds_engine._checkpoint", "_fp32_masters"),
    ("ds_engine._checkpoint", "_load_weights_from_shards"),
    ("ds_zero._optimizer", "ZeroOptimizer.refresh_fp32_params"),
)
# The checksum functions, run on the hashing threads: their time is summed over the threads
# (the copies made while hashing, and the gaps of a mapped file, included).
_HASHERS = (
    ("ds_zero._integrity", "_crc_range"),
    ("ds_zero._integrity", "tensor_crcs"),
    ("ds_zero._integrity", "spans_crc"),
    ("ds_zero._checksums", "MappedFile.crcs"),
    ("ds_zero._checksums", "FileCopy.run"),
    ("ds_zero._checksums", "MappedFile.chain"),
)


@contextlib.contextmanager
def _phase_timer(spans: dict[str, list[float]]) -> Iterator[None]:
    """Wall time of each of :data:`_PHASES` on the loading thread, and the summed time of the
    checksum calls on the hashing threads, added to ``spans`` per load."""
    import importlib
    import threading

    lock = threading.Lock()
    patched = []

    def wrap(label: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with lock:
                    spans.setdefault(label, [0.0])[-1] += time.perf_counter() - start

        return timed

    targets = [*_PHASES, *_HASHERS]
    for module_name, attr in targets:
        owner: object = importlib.import_module(module_name)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        patched.append((owner, name, getattr(owner, name)))
        setattr(
            owner,
            name,
            wrap(
                attr if (module_name, attr) not in _HASHERS else "hash threads (sum)",
                patched[-1][2],
            ),
        )
    try:
        yield
    finally:
        for owner, name, fn in reversed(patched):
            setattr(owner, name, fn)


def _minor_faults() -> int:
    """This process's minor page faults so far (all threads): a load that writes into memory
    the process never wrote before faults each page in (ds-zero's [Note: copying while
    verifying])."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _drop_cached_pages(folder: str) -> None:
    """Evict every file of ``folder`` from the page cache (clean pages: flushed first)."""
    for directory, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


_ARMS = ("without verify", "with verify")


def _measure(engine, root: str, load: dict, args: argparse.Namespace) -> dict:
    """Median wall and CPU seconds of each arm over ``args.rounds`` alternating rounds (and the
    phases' spans when ``args.phases``)."""
    folder = os.path.join(root, "bench")
    engine.load_checkpoint(root, tag="bench", **load)  # warm the page cache, both arms
    with _unverified(args.mapped_baseline):
        engine.load_checkpoint(root, tag="bench", **load)
    wall: dict[str, list[float]] = {arm: [] for arm in _ARMS}
    cpu: dict[str, list[float]] = {arm: [] for arm in _ARMS}
    faults: dict[str, list[int]] = {arm: [] for arm in _ARMS}
    spans: dict[str, dict[str, list[float]]] = {arm: {} for arm in _ARMS}

    def timed(arm: str) -> None:
        if args.cold:
            _drop_cached_pages(folder)
        phases = contextlib.nullcontext()
        if args.phases:
            for values in spans[arm].values():
                values.append(0.0)
            phases = _phase_timer(spans[arm])
        with (
            _unverified(args.mapped_baseline)
            if arm == "without verify"
            else contextlib.nullcontext(),
            phases,
        ):
            faulted = _minor_faults()
            start, start_cpu = time.perf_counter(), time.process_time()
            engine.load_checkpoint(root, tag="bench", **load)
            wall[arm].append(time.perf_counter() - start)
            cpu[arm].append(time.process_time() - start_cpu)
            faults[arm].append(_minor_faults() - faulted)

    for i in range(args.rounds):  # alternate which arm goes first
        for arm in _ARMS[:: 1 if i % 2 == 0 else -1]:
            timed(arm)
    ratios = [b / a - 1 for a, b in zip(wall[_ARMS[0]], wall[_ARMS[1]])]
    return {
        "paired": statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3,
        "wall": {arm: statistics.median(v) for arm, v in wall.items()},
        "cpu": {arm: statistics.median(v) for arm, v in cpu.items()},
        "faults": {arm: statistics.median(v) for arm, v in faults.items()},
        "spans": spans,
        "times": wall,
    }


def _settings(args: argparse.Namespace) -> list[tuple[int, bool]]:
    """``(stage, load_optimizer_states)`` of each row asked for."""
    stages = [args.stage] if args.stage else [2, 3]
    loads = [False] if args.no_optimizer_states else [True, False]
    return [(stage, full) for stage in stages for full in loads]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "checkpoint verification cost").splitlines()[0]
    )
    parser.add_argument("--params", type=float, default=50.0, help="million parameters")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--stage", type=int, default=None, choices=(1, 2, 3), help="only this ZeRO stage"
    )
    parser.add_argument(
        "--cold", action="store_true", help="drop the files' cached pages before every load"
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="also time each load phase (median milliseconds per arm; adds a little overhead)",
    )
    parser.add_argument(
        "--no-optimizer-states",
        action="store_true",
        help="only the weights-only loads (load_checkpoint(load_optimizer_states=False))",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="run the whole measurement in this many fresh processes, one after another, and "
        "give the median over them (a process's speed can differ from the next one's by more "
        "than the checks cost)",
    )
    parser.add_argument(
        "--first-loads",
        type=int,
        default=0,
        metavar="N",
        help="instead, time the first load of a fresh process (a job's one load at its start), "
        "in N processes per arm, the arms alternating (the page cache warm)",
    )
    parser.add_argument(
        "--mapped-baseline",
        action="store_true",
        help="the load without verify maps the model file and uses its tensors in place (no "
        "copy: the fastest unchecked read of it) instead of reading them into memory",
    )
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # a child's rows
    # A --first-loads child: load this checkpoint once, this arm, and print the seconds.
    parser.add_argument("--first-child", nargs=2, metavar=("ROOT", "ARM"), help=argparse.SUPPRESS)
    return parser


def _one_rank(fresh_port: bool = False) -> None:
    """The environment of a one-rank job, on a free port (unless one is set already and
    ``fresh_port`` is False)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    if fresh_port:
        os.environ["MASTER_PORT"] = port
    else:
        os.environ.setdefault("MASTER_PORT", port)


def _measure_here(args: argparse.Namespace) -> tuple[list[tuple[str, dict]], float]:
    """Each setting's measurement in this process, and the parameter count."""
    import torch

    _one_rank()
    rows = []
    settings = _settings(args)
    params = 0.0
    for stage in dict.fromkeys(stage for stage, _ in settings):
        engine = _engine(args.params, args.width, stage)
        x = torch.randn(2, args.width)
        engine.backward(engine(x).square().mean())
        engine.step()
        with tempfile.TemporaryDirectory() as root:
            engine.save_checkpoint(root, tag="bench")
            folder = os.path.join(root, "bench")
            size = sum(
                os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs
            )
            for _, full in (s for s in settings if s[0] == stage):
                load = {"load_optimizer_states": full}
                what = "full load" if full else "weights only (load_optimizer_states=False)"
                result = _measure(engine, root, load, args)
                rows.append((f"ZeRO-{stage}, {what}, {size / 2**20:.0f} MiB", result))
        params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    return rows, params


def _in_processes(args: argparse.Namespace) -> tuple[list[tuple[str, dict]], float]:
    """The measurement run in ``args.processes`` fresh processes, one after another: per
    setting, the median over the processes of each median, and each process's paired
    overhead (``"each"``)."""
    argv = [f"--params={args.params}", f"--width={args.width}", f"--rounds={args.rounds}"]
    argv += [f"--stage={args.stage}"] if args.stage else []
    argv += ["--cold"] if args.cold else []
    argv += ["--no-optimizer-states"] if args.no_optimizer_states else []
    argv += ["--mapped-baseline"] if args.mapped_baseline else []
    runs = []
    for i in range(args.processes):
        proc = subprocess.run(
            [sys.executable, __file__, *argv, "--json"],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise SystemExit(f"process {i + 1} of {args.processes} failed:\n{proc.stderr[-3000:]}")
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        _same_baseline(args, runs[-1]["baseline"], f"process {i + 1}")
        paired = ", ".join(
            f"{100 * r['paired'][1]:+.1f}% ({r['faults'][_ARMS[0]]:.0f} / "
            f"{r['faults'][_ARMS[1]]:.0f} faults)"
            for _, r in runs[-1]["rows"]
        )
        print(
            f"process {i + 1}/{args.processes}: paired overhead (median minor page faults a "
            f"load without / with verify) {paired}",
            file=sys.stderr,
        )
    rows = []
    for k, (name, _) in enumerate(runs[0]["rows"]):
        results = [run["rows"][k][1] for run in runs]
        each = [r["paired"][1] for r in results]
        rows.append(
            (
                name,
                {
                    "paired": [min(each), statistics.median(each), max(each)],
                    "each": each,
                    **{
                        key: {arm: statistics.median(r[key][arm] for r in results) for arm in _ARMS}
                        for key in ("wall", "cpu", "faults")
                    },
                },
            )
        )
    return rows, runs[0]["params"]


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.processes < 1:
        parser.error(f"--processes {args.processes}: give 1 or more")
    if args.phases and args.processes > 1:
        parser.error("--phases times the loads of one process: leave out --processes")
    if args.first_loads and (args.processes > 1 or args.cold):
        parser.error(
            "--first-loads times one warm load a process: leave out --processes and --cold"
        )
    if args.first_child:
        _first_child(args, *args.first_child)
        return
    if args.first_loads:
        _first_loads(args)
        return
    load_before = os.getloadavg()[0]
    if args.processes > 1:
        rows, params = _in_processes(args)
    else:
        rows, params = _measure_here(args)
    if args.json:
        keep = ("paired", "wall", "cpu", "faults")
        out = [(name, {k: result[k] for k in keep}) for name, result in rows]
        print(json.dumps({"rows": out, "params": params, "baseline": _baseline(args)}))
        return
    where = (
        f"median of {args.rounds} alternating rounds"
        if args.processes == 1
        else f"{args.processes} processes of {args.rounds} alternating rounds each, the median "
        "over the processes"
    )
    import torch

    print(
        f"\n{params / 1e6:.1f}M parameters, {os.cpu_count()} CPUs, torch threads "
        f"{torch.get_num_threads()}, {'cold' if args.cold else 'warm'} page cache, {where}; "
        f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after (a busy machine "
        f"leaves no core for the checksum threads); {_baseline(args)}"
    )
    spread = "[quartiles]" if args.processes == 1 else "[lowest, highest process]"
    print(
        "| setting | load without verify (s) | with verify (s) | overhead "
        f"| paired overhead {spread} | CPU without (s) | CPU with (s) | CPU overhead |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, result in rows:
        wall, cpu = result["wall"], result["cpu"]
        a, b = wall["without verify"], wall["with verify"]
        ca, cb = cpu["without verify"], cpu["with verify"]
        low, mid, high = result["paired"]
        print(
            f"| {name} | {a:.3f} | {b:.3f} | {100 * (b / a - 1):+.1f}% "
            f"| {100 * mid:+.1f}% [{100 * low:+.1f}%, {100 * high:+.1f}%] "
            f"| {ca:.3f} | {cb:.3f} | {100 * (cb / ca - 1):+.1f}% |"
        )
    for name, result in rows:
        if "each" in result:
            each = ", ".join(f"{100 * x:+.1f}%" for x in result["each"])
            print(f"\n{name}: paired overhead of each process: {each}")
            print(_interval_line(result["each"]))
    if args.phases:
        for name, result in rows:
            print(f"\n{name}")
            _print_phases(result["spans"], result["times"], result["faults"])


def _first_child(args: argparse.Namespace, root: str, arm: str) -> None:
    """One load of ``root``'s checkpoint, the first of this process, in ``arm``; prints its
    wall seconds and the baseline it ran, as JSON."""
    import importlib

    _one_rank(fresh_port=True)  # not the parent's, which it still holds
    engine = _engine(args.params, args.width, args.stage)
    # Imported by both arms before the clock starts: _unverified() imports them to patch them,
    # and the first load imports them otherwise (15-20 ms on the 2-core VM).
    for module in ("ds_engine._checkpoint", "ds_zero._checkpoint", "ds_zero._consolidate"):
        importlib.import_module(module)
    unverified = _unverified(args.mapped_baseline) if arm == "without verify" else None
    spans: dict[str, list[float]] = {}
    with (
        unverified or contextlib.nullcontext(),
        _phase_timer(spans) if args.phases else contextlib.nullcontext(),
    ):
        faulted = _minor_faults()
        start = time.perf_counter()
        engine.load_checkpoint(
            root, tag="bench", load_optimizer_states=not args.no_optimizer_states
        )
        seconds = time.perf_counter() - start
        faults = _minor_faults() - faulted
    run = {"seconds": seconds, "faults": faults, "spans": spans, "baseline": _baseline(args)}
    print(json.dumps(run))


def _baseline(args: argparse.Namespace) -> str:
    """How the load without verify reads the model file (see ``--mapped-baseline``)."""
    how = "mapped and used in place" if args.mapped_baseline else "read into memory"
    return f"without verify, the model file {how}"


def _same_baseline(args: argparse.Namespace, reported: str, who: str) -> None:
    """Stop unless a child process loaded with the baseline this one was asked for."""
    if reported != _baseline(args):
        raise SystemExit(f"{who} ran {reported!r}, not {_baseline(args)!r}")


def _first_loads(args: argparse.Namespace) -> None:
    """Per setting, the first load of ``args.first_loads`` fresh processes per arm, the arms
    alternating which goes first, and the overhead of each pair of processes."""
    import torch

    _one_rank()
    argv = [f"--params={args.params}", f"--width={args.width}"]
    print(
        f"\nfirst load of a fresh process, {args.first_loads} processes per arm, {os.cpu_count()} "
        f"CPUs, warm page cache; {_baseline(args)}"
    )
    print("| setting | median without verify (s) | with verify (s) | median paired overhead |")
    print("|---|---|---|---|")
    lines = []
    phases = []
    for stage, full in _settings(args):
        engine = _engine(args.params, args.width, stage)
        engine.backward(engine(torch.randn(2, args.width)).square().mean())
        engine.step()
        with tempfile.TemporaryDirectory() as root:
            engine.save_checkpoint(root, tag="bench")
            times: dict[str, list[float]] = {arm: [] for arm in _ARMS}
            faults: dict[str, list[int]] = {arm: [] for arm in _ARMS}
            spans: dict[str, dict[str, list[float]]] = {arm: {} for arm in _ARMS}
            for i in range(args.first_loads):
                for arm in _ARMS[:: 1 if i % 2 == 0 else -1]:
                    child = [f"--stage={stage}", "--first-child", root, arm]
                    child += [] if full else ["--no-optimizer-states"]
                    child += ["--mapped-baseline"] if args.mapped_baseline else []
                    child += ["--phases"] if args.phases else []
                    proc = subprocess.run(
                        [sys.executable, __file__, *argv, *child],
                        capture_output=True,
                        text=True,
                        check=False,
                    )
                    if proc.returncode != 0:
                        raise SystemExit(f"a {arm} first load failed:\n{proc.stderr[-3000:]}")
                    child_run = json.loads(proc.stdout.strip().splitlines()[-1])
                    _same_baseline(args, child_run["baseline"], f"a {arm} first load")
                    times[arm].append(float(child_run["seconds"]))
                    print(
                        f"ZeRO-{stage} {'full' if full else 'weights only'}, process "
                        f"{len(times[arm])} {arm}: {1e3 * times[arm][-1]:.1f} ms, "
                        f"{child_run['faults']} minor faults",
                        file=sys.stderr,
                    )
                    faults[arm].append(child_run["faults"])
                    # one value a process per phase: 0 where this process, or an earlier one,
                    # did not run it
                    done = len(times[arm]) - 1
                    for label in dict.fromkeys([*spans[arm], *child_run["spans"]]):
                        spans[arm].setdefault(label, [0.0] * done)
                        spans[arm][label] += child_run["spans"].get(label, [0.0])
        what = "full load" if full else "weights only (load_optimizer_states=False)"
        pairs = [b / a - 1 for a, b in zip(times[_ARMS[0]], times[_ARMS[1]])]
        a, b = (statistics.median(times[arm]) for arm in _ARMS)
        print(
            f"| ZeRO-{stage}, {what} | {a:.3f} | {b:.3f} | {100 * statistics.median(pairs):+.1f}% |"
        )
        lines.append(f"\nZeRO-{stage}, {what}: {_interval_line(pairs)}")
        if args.phases:
            median_faults = {arm: statistics.median(faults[arm]) for arm in _ARMS}
            phases.append((f"ZeRO-{stage}, {what}", spans, times, median_faults))
    print("\n".join(lines))
    for name, *table in phases:
        print(f"\n{name}, first loads")
        _print_phases(*table)


def _interval_line(each: list[float]) -> str:
    """The 95% interval for the median of the processes' paired overheads, and what it says of
    the target."""
    interval = median_interval(each)
    where = ""
    if interval is not None:
        where = (
            f"[{100 * interval.low:+.1f}%, {100 * interval.high:+.1f}%] (order statistics "
            f"{interval.rank} and {len(each) + 1 - interval.rank} of {len(each)} processes, "
            f"{100 * interval.coverage:.1f}% coverage); "
        )
    verdict = against_target(interval, TARGET)
    return f"95% interval for the median: {where}the {100 * TARGET:.0f}% target: {verdict}"


def _print_phases(
    spans: dict[str, dict[str, list[float]]],
    times: dict[str, list[float]],
    faults: dict[str, float],
) -> None:
    """The median milliseconds of each phase per arm (a phase first met in a later load counts 0
    in the earlier ones), the whole load's, and each arm's median minor page faults."""
    print("| phase (median ms) | without verify | with verify |")
    print("|---|---|---|")
    labels = dict.fromkeys(k for arm in spans.values() for k in arm)
    for label in labels:
        row = []
        for arm in _ARMS:
            values = spans[arm].get(label, [])
            values = [0.0] * (len(times[arm]) - len(values)) + values
            row.append(f"{statistics.median(values) * 1e3:.2f}" if values else "-")
        print(f"| {label} | {row[0]} | {row[1]} |")
    print(
        f"| whole load | {statistics.median(times['without verify']) * 1e3:.2f} | "
        f"{statistics.median(times['with verify']) * 1e3:.2f} |"
    )
    print(
        f"| minor page faults (median, not ms) | {faults[_ARMS[0]]:.0f} | {faults[_ARMS[1]]:.0f} |"
    )


if __name__ == "__main__":
    main()
