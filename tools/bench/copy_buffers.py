"""What a masters-only load's copy buffer costs new and kept (ds-zero's [Note: copy buffers kept
for the next load]).

In each of ``--processes`` fresh processes, ``--rounds`` rounds copy and hash a ``--mb``
megabyte file (in the page cache, mapped) on a thread, as ds-zero's checksum jobs copy a shard
file's fp32 masters (``ds_native.crc32_copy_spans`` into a ``CopiedTensors``), into each of:

* a **new** buffer: a fresh mapping advised huge pages (what every load got before buffers were
  kept; the kept one is dropped first);
* the **kept** buffer: the one the last round released (``CopiedTensors.release``).

The two arms alternate, and which goes first alternates by round. Each process prints a line
(the median and the slowest round of each arm); the table gives, over every round of every
process, each arm's median, 90th percentile and slowest copy, the median of its kernel time
(the thread's system time: faults, zeroing) and of its minor page faults.

Usage (from the workspace root)::

    OMP_NUM_THREADS=1 .venv/bin/python tools/bench/copy_buffers.py --mb 40 --processes 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ARMS = ("new", "kept")


def _child(path: str, rounds: int, tensors: int) -> None:
    """Time the rounds in this process; print one JSON line: per arm, per round, (ms, kernel
    ms, faults)."""
    import mmap
    import resource
    import time
    from concurrent.futures import ThreadPoolExecutor

    from ds_native import crc32_copy_spans
    from ds_zero import _verified_copies
    from ds_zero._verified_copies import CopiedTensors

    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    size = len(mapping) // tensors
    spans = [(i * size, size) for i in range(tensors)]
    entries = {
        f"t{i}": {"dtype": "torch.uint8", "shape": [size], "nbytes": size} for i in range(tensors)
    }
    times: dict[str, list[tuple[float, float, int]]] = {arm: [] for arm in ARMS}
    # One thread for every round, as ds-zero's checksum threads outlive a load: a new thread's
    # first call allocates (its stack, its frames) and may fault a page that is not the buffer's.
    worker = ThreadPoolExecutor(1)

    def copy_once() -> tuple[float, float, int]:
        copies = CopiedTensors.of(entries, list(entries))
        assert copies is not None
        got: list[tuple[float, float, int]] = []
        # The buffer and the offsets, taken by the job: its locals are gone when it returns,
        # whereas the executor holds a job's arguments until after the result is set, and a
        # buffer still viewed then is not kept. One destination, the buffer: every span.
        ((buffer, _, offsets),) = copies.next_run(spans)
        handed = [(buffer, offsets)]
        del buffer

        def job() -> None:
            out, at = handed.pop()
            before, start = resource.getrusage(resource.RUSAGE_THREAD), time.perf_counter()
            crc32_copy_spans(mapping, spans, out, at=at)
            took, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_THREAD)
            kernel = after.ru_stime - before.ru_stime
            got.append((took * 1e3, kernel * 1e3, after.ru_minflt - before.ru_minflt))

        worker.submit(job).result()
        copies.release()
        return got[0]

    copy_once()  # the first round of a process maps its kept buffer: not timed
    for r in range(rounds):
        for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
            if arm == "new":
                _verified_copies._kept.clear()  # unmapped here, untimed
            times[arm].append(copy_once())
    print(json.dumps(times))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--mb", type=float, default=40.0, help="megabytes copied per round")
    parser.add_argument("--tensors", type=int, default=10, help="tensors the file is split into")
    parser.add_argument("--rounds", type=int, default=9, help="rounds of each arm per process")
    parser.add_argument("--processes", type=int, default=6)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.rounds, args.tensors)
        return
    if args.mb <= 0 or min(args.tensors, args.rounds, args.processes) < 1:
        parser.error(
            f"--mb {args.mb}, --tensors {args.tensors}, --rounds {args.rounds}, --processes "
            f"{args.processes}: give a positive size and at least one of each"
        )
    import ds_native
    from ds_zero._verified_copies import huge_pages_offered

    if not ds_native.native_available():
        sys.exit("ds-native's C extension is not built: nothing is copied while hashing")
    if not huge_pages_offered():
        sys.exit("this kernel offers no transparent huge pages: copies use torch.empty memory")
    every: dict[str, list[tuple[float, float, int]]] = {arm: [] for arm in ARMS}
    with tempfile.NamedTemporaryFile(prefix="copy_buffers_") as source:
        source.write(os.urandom(int(args.mb * 1e6) // args.tensors * args.tensors))
        source.flush()
        for p in range(args.processes):
            command = [sys.executable, __file__, "--child", source.name]
            command += ["--rounds", str(args.rounds), "--tensors", str(args.tensors)]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
            times = json.loads(out.splitlines()[-1])
            each = []
            for arm in ARMS:
                every[arm] += [tuple(t) for t in times[arm]]
                ms = [t[0] for t in times[arm]]
                each.append(f"{arm} {statistics.median(ms):.1f} ms (slowest {max(ms):.1f})")
            print(f"process {p + 1}/{args.processes}: " + ", ".join(each))
    print(
        f"\n{args.mb:g} MB in {args.tensors} tensors copied and hashed on a thread, "
        f"{args.rounds} rounds of each arm in each of {args.processes} processes"
    )
    print("| buffer | median ms | 90th percentile ms | slowest ms | kernel ms (median) | faults |")
    print("|---|---|---|---|---|---|")
    for arm in ARMS:
        ms = [t[0] for t in every[arm]]
        kernel = statistics.median(t[1] for t in every[arm])
        faults = statistics.median(t[2] for t in every[arm])
        print(
            f"| {arm} | {statistics.median(ms):.1f} | {_percentile(ms, 0.9):.1f} | "
            f"{max(ms):.1f} | {kernel:.1f} | {faults:g} |"
        )


if __name__ == "__main__":
    main()
