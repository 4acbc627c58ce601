"""What checkpoint verification costs: ``load_checkpoint`` with and without the integrity check.

One process saves a ZeRO-2 engine (a stack of ``--width`` x ``--width`` linear layers, Adam,
``--params`` million parameters) once, then loads it ``--rounds`` times each way, alternating:

* ``verified``: ``engine.load_checkpoint`` as shipped: ``ds_manifest.json`` read, every file's
  16 MiB-chunk CRC-32 checked on ``min(8, cpus)`` threads while the load reads the files (see
  ds-zero's [Note: verification overlapped with reading]), the zero manifest's seal, bindings
  and coverage checked, the verdict waited for, then the values written;
* ``unverified``: the same load with the checks replaced by no-ops (what loading cost before).

The table gives the median of each, the checksum time alone (``verify_directory``, not
overlapped), and the overhead (verified / unverified - 1). The target is under 5% of load time.
One load of each arm first warms the page cache, so both measure loads from memory (the worst
case for the overhead: a cold disk makes the load slower and the same check relatively
cheaper), and the arms alternate which goes first in each round. ``--cold`` drops the
checkpoint's pages from the page cache before every timed load (``posix_fadvise(DONTNEED)`` on
each file, no root needed), so both arms read from the disk, as a job does when it starts.
``--stage 3 --no-optimizer-states`` measures the path that reads the weights from the zero
shards.

Usage (from the workspace root)::

    uv run python tools/bench/checkpoint_verify.py                  # ~50M params
    uv run python tools/bench/checkpoint_verify.py --params 5 --rounds 3   # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Iterator

import torch


def _engine(params_m: float, width: int, stage: int):
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
    """A pending verification that checks nothing (what loading cost before the checks)."""

    manifest: dict = {}

    def note(self, problem: str) -> None:
        raise RuntimeError(problem)

    def wait(self, problems=()) -> dict:
        return {}

    def close(self) -> None:
        pass

    def __enter__(self) -> _NoCheck:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


@contextlib.contextmanager
def _unverified() -> Iterator[None]:
    """Loading with the integrity checks made no-ops."""
    import ds_engine._checkpoint as engine_ckpt
    import ds_zero._checkpoint as zero_ckpt
    import ds_zero._consolidate as zero_consolidate

    saved = (
        engine_ckpt.start_verification,
        zero_ckpt.binding_problems,
        zero_consolidate.verify_directory,
    )
    engine_ckpt.start_verification = lambda *a, **k: _NoCheck()
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


# (module, attribute) of each load phase timed by --phases; start_verification and the wait are
# the verification's own, the others run in both arms.
_PHASES = (
    ("ds_engine._checkpoint", "start_verification"),
    ("ds_engine._checkpoint", "_read_model_file"),
    ("ds_zero._checkpoint", "verify_checkpoint"),
    ("ds_zero._zero_shards", "_read_shards"),
    ("ds_zero._integrity", "PendingVerification.wait"),
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

    targets = [*_PHASES, ("ds_zero._integrity", "_crc_range")]
    for module_name, attr in targets:
        owner: object = importlib.import_module(module_name)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        patched.append((owner, name, getattr(owner, name)))
        setattr(
            owner,
            name,
            wrap(attr if attr != "_crc_range" else "hash threads (sum)", patched[-1][2]),
        )
    try:
        yield
    finally:
        for owner, name, fn in reversed(patched):
            setattr(owner, name, fn)


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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "checkpoint verification cost").splitlines()[0]
    )
    parser.add_argument("--params", type=float, default=50.0, help="million parameters")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument(
        "--cold", action="store_true", help="drop the files' cached pages before every load"
    )
    parser.add_argument(
        "--phases",
        action="store_true",
        help="also time each load phase (median seconds per arm; adds a little overhead)",
    )
    parser.add_argument(
        "--no-optimizer-states",
        action="store_true",
        help="load_checkpoint(load_optimizer_states=False) (stage 3: weights from the shards)",
    )
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    from ds_zero import verify_directory

    engine = _engine(args.params, args.width, args.stage)
    x = torch.randn(2, args.width)
    engine.backward(engine(x).square().mean())
    engine.step()
    load = {"load_optimizer_states": not args.no_optimizer_states}
    with tempfile.TemporaryDirectory() as root:
        engine.save_checkpoint(root, tag="bench")
        folder = os.path.join(root, "bench")
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)
        engine.load_checkpoint(root, tag="bench", **load)  # warm the page cache, both arms
        with _unverified():
            engine.load_checkpoint(root, tag="bench", **load)
        times: dict[str, list[float]] = {"verified": [], "unverified": [], "checksums": []}
        cpu: dict[str, list[float]] = {k: [] for k in times}
        spans: dict[str, dict[str, list[float]]] = {"verified": {}, "unverified": {}}

        def timed(arm: str) -> None:
            if args.cold:
                _drop_cached_pages(folder)
            phases = contextlib.nullcontext()
            if args.phases and arm in spans:
                for values in spans[arm].values():
                    values.append(0.0)
                phases = _phase_timer(spans[arm])
            with (
                _unverified() if arm == "unverified" else contextlib.nullcontext(),
                phases,
            ):
                start, start_cpu = time.perf_counter(), time.process_time()
                if arm == "checksums":
                    verify_directory(folder)
                else:
                    engine.load_checkpoint(root, tag="bench", **load)
                times[arm].append(time.perf_counter() - start)
                cpu[arm].append(time.process_time() - start_cpu)

        for i in range(args.rounds):  # alternate which arm goes first
            for arm in ("verified", "unverified")[:: 1 if i % 2 == 0 else -1]:
                timed(arm)
            timed("checksums")
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    print(
        f"{params / 1e6:.1f}M parameters, checkpoint {size / 2**20:.0f} MiB, "
        f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
        f"ZeRO-{args.stage}, {load}, {'cold' if args.cold else 'warm'} page cache, "
        f"median of {args.rounds}"
    )
    print(f"load average {os.getloadavg()[0]:.1f} (a busy machine leaves no core for the overlap)")
    print("| load | seconds | MiB/s | CPU seconds (all threads) |")
    print("|---|---|---|---|")
    for key in ("unverified", "verified", "checksums"):
        print(f"| {key} | {med[key]:.3f} | {size / 2**20 / med[key]:.0f} | {med_cpu[key]:.3f} |")
    overhead = 100 * (med["verified"] / med["unverified"] - 1)
    cpu_overhead = 100 * (med_cpu["verified"] / med_cpu["unverified"] - 1)
    print(f"| overhead | {overhead:+.1f}% | | {cpu_overhead:+.1f}% |")
    if args.phases:
        _print_phases(spans, times)


def _print_phases(spans: dict[str, dict[str, list[float]]], times: dict[str, list[float]]) -> None:
    """The median seconds of each phase per arm (a phase first met in a later load counts 0
    in the earlier ones)."""
    print("\n| phase (median s) | unverified | verified |")
    print("|---|---|---|")
    labels = dict.fromkeys(k for arm in spans.values() for k in arm)
    for label in labels:
        row = []
        for arm in ("unverified", "verified"):
            values = spans[arm].get(label, [])
            values = [0.0] * (len(times[arm]) - len(values)) + values
            row.append(f"{statistics.median(values):.3f}" if values else "-")
        print(f"| {label} | {row[0]} | {row[1]} |")
    print(
        f"| whole load | {statistics.median(times['unverified']):.3f} | "
        f"{statistics.median(times['verified']):.3f} |"
    )


if __name__ == "__main__":
    main()
