"""Disk bandwidth: ds-offload-aio's AioHandle next to fio and torch.save/torch.load, in one run.

On one directory and one total size:

1. fio sweep (the peer): ``--ioengine=libaio --direct=1 --bs=1M`` sequential write then read,
   over numjobs 1/2/4 x iodepth 32/128 x fio's buffers in 4 KiB pages or in transparent huge
   pages (glibc's ``glibc.malloc.hugetlb=1`` tunable; AioHandle's locked buffers get huge pages,
   see [Note: huge pages for locked buffers] in ds_offload_aio/_pinned.py, so fio gets the same
   chance), the total size split across the jobs. One fio setting understates the device; the
   sweep picks fio's best setting for read and for write. fio's rate is measured like
   AioHandle's, by the clock on the wall: see [Note: fio's rate by the wall clock].
2. AioHandle's configuration: the best from the tuner (``ds_offload_aio.tune``, the engine of
   ``ds-nvme-tune``), or the one given with ``--aio-config``.
3. Head to head, interleaved so that drift and neighbours' load hit both alike: per repeat, fio's
   best write setting, AioHandle ``sync_pwrite`` of one page-locked buffer of the total size to one
   file, fio's best read setting, AioHandle ``sync_pread``; all O_DIRECT. File state is the same
   on both sides: every timed write overwrites blocks already allocated and written (fio's files
   were written by the sweep, AioHandle's file by an untimed write first), every read reads them.
   The verdict compares the best of these runs. For context, not for the verdict, each repeat
   also runs fio's best settings with buffers spanning the whole size (``spread_buffers``): as
   much memory as AioHandle's tensor, instead of a small ring the CPU caches hold.
4. ``torch.save`` (with fsync) and ``torch.load`` of the same bytes; before each load the file's
   pages are dropped from the page cache (``posix_fadvise(DONTNEED)``, no root needed).

Rates are GB/s (10^9 bytes/s), best of ``--repeats``. The target: AioHandle >= 95% of fio's best
for both read and write, i.e. the disk, not the handle, is the limit; the CPU AioHandle used while
moving the bytes (process CPU time / wall time) is printed too.

Usage (from the workspace root)::

    uv run python tools/bench/aio.py --dir /nvme/scratch                  # 1 GiB, tuned
    uv run python tools/bench/aio.py --dir /nvme/scratch --size 4G --repeats 5
    uv run python tools/bench/aio.py --dir /nvme/scratch \\
        --aio-config '{"block_size": 1048576, "queue_depth": 32, "intra_op_parallelism": 4}'

[Note: fio's rate by the wall clock]
fio's own figure for a group of jobs (``bw_bytes`` with ``--group_reporting``) divides all the
jobs' bytes by the longest single job's runtime, and each job's clock starts when that job
starts. fio's jobs start up to tens of milliseconds apart (each process sets up its own buffers
and files), so with numjobs > 1 the jobs overlap only in part and the figure overstates what the
disk did: on the development VM a 512 MiB write that took 138 ms from the first request to the
last completion (3.88 GB/s) was reported at 6.03 GB/s, a sweep's row at 8.01 on a disk that moves
about 4, and the best of a sweep picks exactly those runs. So every fio run here also writes its latency log with
Unix timestamps (``--write_lat_log --log_unix_epoch=1``: each request's completion time and
latency) and its rate is its bytes over the span from the first request's submission to the last
completion, in any job: the wall clock, as AioHandle's rate is (which also counts opening the
file and Python). For numjobs=1 the two agree within the log's 1 ms resolution; the sweep table
prints both.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ds_offload_aio import AioConfig, AioHandle, backend_info, tune
from ds_offload_aio._tune import format_table, parse_size

FIO_NUMJOBS = (1, 2, 4)
FIO_IODEPTHS = (32, 128)
FIO_HUGE_PAGES = (False, True)
QUICK_SWEEP = {
    "block_size": ["1M"],
    "queue_depth": [8, 32, 128],
    "intra_op_parallelism": [1, 2, 4, 8],
    "single_submit": [False],
    "overlap_events": [True, False],
}
TARGET = 0.95


@dataclass(frozen=True)
class FioRate:
    """One fio run in GB/s: by the wall clock, and as fio reports it."""

    wall: float  # all bytes / (last completion - first submission); see the Note
    reported: float  # fio's group figure: all bytes / the longest job's own runtime


@dataclass(frozen=True)
class Fio:
    """One fio setting; its files (one per job, named by numjobs) are kept until the end."""

    directory: str
    size: int
    numjobs: int
    iodepth: int
    huge_pages: bool = False  # fio's io buffers (glibc malloc) advised MADV_HUGEPAGE

    @property
    def name(self) -> str:
        pages = " thp" if self.huge_pages else ""
        return f"fio numjobs={self.numjobs} iodepth={self.iodepth}{pages}"

    def run(self, rw: str) -> FioRate:
        """One fio run, rated from its latency log (see [Note: fio's rate by the wall clock])."""
        with tempfile.TemporaryDirectory(prefix="fio-log-") as logs:
            args = [
                "fio", f"--name=ds_aio_bench_j{self.numjobs}", f"--directory={self.directory}",
                "--ioengine=libaio", "--direct=1", "--bs=1M", f"--iodepth={self.iodepth}",
                f"--numjobs={self.numjobs}", f"--size={self.size // self.numjobs >> 20}M",
                f"--rw={rw}", "--group_reporting", "--output-format=json",
                f"--write_lat_log={logs}/run", "--log_unix_epoch=1",
            ]  # fmt: skip
            if rw == "read":  # buffers touched before the clock starts, as AioHandle's are
                args.append("--zero_buffers=1")
            env = dict(os.environ)
            if self.huge_pages:
                tunables = [env["GLIBC_TUNABLES"]] if env.get("GLIBC_TUNABLES") else []
                env["GLIBC_TUNABLES"] = ":".join([*tunables, "glibc.malloc.hugetlb=1"])
            proc = subprocess.run(args, capture_output=True, text=True, check=False, env=env)
            if proc.returncode != 0:
                sys.exit(f"fio failed ({' '.join(args)}):\n{proc.stderr}")
            report = json.loads(proc.stdout[proc.stdout.index("{") :])  # fio may print notes first
            stats = report["jobs"][0][rw]
            span_ms = _io_span_ms(logs, stats["io_bytes"])
        return FioRate(stats["io_bytes"] / span_ms / 1e6, stats["bw_bytes"] / 1e9)


def _io_span_ms(logs: str, io_bytes: int) -> float:
    """Milliseconds from the first request's submission to the last completion, any job.

    Each line of a ``*_lat.N.log`` is ``completion time (Unix ms), latency (ns), direction,
    bytes, offset``; a request was submitted at completion time minus latency.
    """
    first, last, logged = float("inf"), float("-inf"), 0
    for name in os.listdir(logs):
        if "_lat." not in name:  # fio writes clat and slat logs beside it
            continue
        with open(os.path.join(logs, name)) as log:
            for line in log:
                done_ms, latency_ns, _, nbytes = (int(x) for x in line.split(",")[:4])
                first = min(first, done_ms - latency_ns / 1e6)
                last = max(last, done_ms)
                logged += nbytes
    if logged != io_bytes:
        sys.exit(f"fio's latency logs in {logs} cover {logged} bytes, its report {io_bytes}")
    return max(last - first, 1.0)


@dataclass(frozen=True)
class Row:
    """One line of the table: read and write GB/s."""

    name: str
    read: float
    write: float


def _timed(nbytes: int, run: Callable[[], object]) -> tuple[float, float]:
    """GB/s of one run, and the process's CPU use during it (fraction of one core)."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return nbytes / wall / 1e9, cpu / wall


def fio_sweep(directory: str, size: int, repeats: int) -> tuple[list[tuple[Row, Row]], Fio, Fio]:
    """Every fio setting, best of ``repeats``: (wall-clock row, fio-reported row) per setting,
    and the settings with the best wall-clock read and write."""
    rows, settings = [], []
    for numjobs, iodepth, huge_pages in itertools.product(
        FIO_NUMJOBS, FIO_IODEPTHS, FIO_HUGE_PAGES
    ):
        fio = Fio(directory, size, numjobs, iodepth, huge_pages)
        write = [fio.run("write") for _ in range(repeats)]
        read = [fio.run("read") for _ in range(repeats)]
        rows.append(
            (
                Row(fio.name, max(r.wall for r in read), max(w.wall for w in write)),
                Row(fio.name, max(r.reported for r in read), max(w.reported for w in write)),
            )
        )
        settings.append(fio)
    best_read = settings[max(range(len(rows)), key=lambda i: rows[i][0].read)]
    best_write = settings[max(range(len(rows)), key=lambda i: rows[i][0].write)]
    return rows, best_read, best_write


@dataclass(frozen=True)
class HeadToHead:
    """Best of the interleaved runs; ``spread`` is fio's best settings with its buffers spanning
    the whole size (context, not the verdict), ``cpu`` AioHandle's (read, write) CPU use."""

    fio: Row
    ours: Row
    spread: Row
    cpu: tuple[float, float]


def spread_buffers(fio: Fio) -> Fio:
    """``fio`` with one 1 MiB buffer per request of the run (iodepth = size / numjobs / 1 MiB).

    fio's best settings cycle through numjobs x iodepth x 1 MiB of buffers, which stay in the
    CPU caches (on a virtual disk, the host's); a tensor transfer touches every byte of the
    tensor once. With buffers spanning the whole size fio touches as much memory as AioHandle.
    """
    return dataclasses.replace(fio, iodepth=max(fio.size // fio.numjobs >> 20, 1))


def head_to_head(
    handle: AioHandle, buffer: torch.Tensor, path: str, fio_read: Fio, fio_write: Fio, repeats: int
) -> HeadToHead:
    """Interleaved runs of fio's best settings, the handle and fio with spread buffers."""
    nbytes = buffer.numel()
    handle.sync_pwrite(buffer, path)  # untimed: allocate and write the file, as fio's sweep did
    spread_write, spread_read = spread_buffers(fio_write), spread_buffers(fio_read)
    fio_w, fio_r, ours_w, ours_r, spread_w, spread_r = [], [], [], [], [], []
    for _ in range(repeats):
        fio_w.append(fio_write.run("write").wall)
        ours_w.append(_timed(nbytes, lambda: handle.sync_pwrite(buffer, path)))
        spread_w.append(spread_write.run("write").wall)
        fio_r.append(fio_read.run("read").wall)
        ours_r.append(_timed(nbytes, lambda: handle.sync_pread(buffer, path)))
        spread_r.append(spread_read.run("read").wall)
    fio = Row(f"fio best (read: {fio_read.name[4:]}; write: {fio_write.name[4:]})",
              max(fio_r), max(fio_w))  # fmt: skip
    spread = Row("fio best settings, buffers spanning the size", max(spread_r), max(spread_w))
    (read, read_cpu), (write, write_cpu) = max(ours_r), max(ours_w)
    return HeadToHead(fio, Row(_describe(handle), read, write), spread, (read_cpu, write_cpu))


def _describe(handle: AioHandle) -> str:
    flags = (" single_submit" if handle.get_single_submit() else "") + (
        " overlap_events" if handle.get_overlap_events() else ""
    )
    return (
        f"AioHandle bs={handle.get_block_size() >> 10}K qd={handle.get_queue_depth()} "
        f"par={handle.get_intra_op_parallelism()}{flags}"
    )


def measure_torch(buffer: torch.Tensor, path: str, repeats: int) -> Row:
    """torch.save + fsync, then torch.load from a cold page cache."""

    def save() -> None:
        with open(path, "wb") as f:
            torch.save(buffer, f)
            f.flush()
            os.fsync(f.fileno())

    def load() -> None:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
        torch.load(path, weights_only=True)

    write = max(_timed(buffer.numel(), save)[0] for _ in range(repeats))
    read = max(_timed(buffer.numel(), load)[0] for _ in range(repeats))
    return Row("torch.save / torch.load", read, write)


def print_report(sweep: list[tuple[Row, Row]], result: HeadToHead, torch_row: Row | None) -> None:
    fio, ours, spread, cpu = result.fio, result.ours, result.spread, result.cpu
    width = max(len(r.name) for r in [*(w for w, _ in sweep), fio, ours, spread]) + 2
    print(f"\n{'fio sweep (selects the setting)':{width}}{'read GB/s':>16}{'write GB/s':>16}"
          "   fio's own report (read / write)")  # fmt: skip
    for row, reported in sweep:
        print(f"{row.name:{width}}{row.read:>16.2f}{row.write:>16.2f}"
              f"   {reported.read:.2f} / {reported.write:.2f}")  # fmt: skip
    print(f"\n{'head to head (interleaved)':{width}}{'read GB/s':>16}{'write GB/s':>16}")
    print(f"{fio.name:{width}}{fio.read:>16.2f}{fio.write:>16.2f}")
    for row in (ours, torch_row):
        if row is not None:
            read = f"{row.read:.2f} ({row.read / fio.read:4.0%})"
            write = f"{row.write:.2f} ({row.write / fio.write:4.0%})"
            print(f"{row.name:{width}}{read:>16}{write:>16}")
    print(f"{spread.name:{width}}{spread.read:>16.2f}{spread.write:>16.2f}")
    print(f"\nAioHandle CPU use while moving the bytes: read {cpu[0]:.0%}, write {cpu[1]:.0%} "
          "of one core")  # fmt: skip
    print(f"AioHandle against fio with its buffers spanning the size (context, see "
          f"spread_buffers): read {ours.read / spread.read:.0%}, write "
          f"{ours.write / spread.write:.0%}")  # fmt: skip
    for kind, share in (("read", ours.read / fio.read), ("write", ours.write / fio.write)):
        verdict = "MET" if share >= TARGET else "NOT MET"
        print(f"target {kind}: AioHandle >= {TARGET:.0%} of fio's best: {verdict} ({share:.1%})")


def _huge_page_mib(tensor: torch.Tensor) -> int:
    """MiB of the mapping holding ``tensor`` backed by transparent huge pages (/proc smaps)."""
    address, inside = tensor.data_ptr(), False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                inside = start <= address < end
            elif inside and fields[0] == "AnonHugePages:":
                return int(fields[1]) >> 10
    return 0


def _filesystem(path: str) -> str:
    """Type and mount point holding ``path`` (on tmpfs the numbers would mean nothing)."""
    best = ("?", "?")
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, mount, fstype, *_ = line.split()
            if os.path.realpath(path).startswith(mount) and len(mount) >= len(best[0]):
                best = (mount, fstype)
    return f"{best[1]} at {best[0]}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--dir", help="directory on the disk to measure (default: a temp dir)")
    parser.add_argument("--size", default="1G", help="total bytes per run (default 1G)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement (best)")
    parser.add_argument("--tune-size", default="256M", help="bytes per tuner run (default 256M)")
    parser.add_argument("--sweep", help="tuner sweep as JSON (default: a quick 24-config sweep)")
    parser.add_argument("--aio-config", help="aio section as JSON: skip the tuner, use this")
    parser.add_argument("--skip-torch", action="store_true", help="leave out torch.save/load")
    return parser


def main() -> None:
    args = _parser().parse_args()
    if shutil.which("fio") is None:
        sys.exit("fio is not installed (tools/setup/system-deps.sh installs it)")
    size = parse_size(args.size) // (4 << 20) * (4 << 20)  # whole MiB for every fio job
    directory = tempfile.mkdtemp(prefix="ds-aio-bench-", dir=args.dir)
    info = backend_info()
    print(f"directory {directory} ({_filesystem(directory)}), {size / 2**30:g} GiB per run, "
          f"best of {args.repeats}; AioHandle backend: {info['backend']} {info['reason'] or ''}")  # fmt: skip
    try:
        if args.aio_config:
            config = AioConfig.from_dict(json.loads(args.aio_config))
        else:
            sweep = json.loads(args.sweep) if args.sweep else QUICK_SWEEP
            results = tune(directory, parse_size(args.tune_size), sweep)
            print(format_table(results))
            config = results[0].config
        print("AioHandle config:", json.dumps({"aio": config.handle_kwargs()}))

        sweep_rows, fio_read, fio_write = fio_sweep(directory, size, args.repeats)
        path = os.path.join(directory, "ds_aio_bench.handle")
        with AioHandle.from_config(config) as handle:
            buffer = handle.new_cpu_locked_tensor(size, torch.empty(0, dtype=torch.uint8))
            buffer.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))  # incompressible
            print(f"AioHandle buffer: new_cpu_locked_tensor, {_huge_page_mib(buffer)} of "
                  f"{size >> 20} MiB in huge pages; fio buffers: numjobs x iodepth x 1 MiB, "
                  "'thp' rows in huge pages. Files: timed writes overwrite written blocks and "
                  "reads read them, on both sides")  # fmt: skip
            result = head_to_head(handle, buffer, path, fio_read, fio_write, args.repeats)
        torch_row = None if args.skip_torch else measure_torch(buffer, path, args.repeats)
        print_report(sweep_rows, result, torch_row)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
