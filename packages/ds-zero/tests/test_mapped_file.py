"""Spans of a checkpoint file hashed through one mapping (each span, or the chain of them) or
read one by one (the chain): the values zlib gives, from any thread, and clear errors for a
file shorter than its record."""

from __future__ import annotations

import os
import random
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest

from ds_zero._checksums import MappedFile, _spans_each, in_page_cache, on_disk, spans_crc
from ds_zero._read_checks import _AHEAD_JOB, HelpedPool, ahead_jobs

sys.path.insert(0, str(Path(__file__).parent))
from _ds_zero_testing import drop_cached_pages


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = random.Random(0).randbytes(3 << 20)
    path = tmp_path / "shard.pt"
    path.write_bytes(data)
    return path, data


def test_each_span_and_the_chain_equal_zlib(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    spans = [(0, 10), (4096, 1 << 20), (5, 0), (len(data) - 7, 7), (70_000, 3)]
    joined = b"".join(data[a : a + n] for a, n in spans)
    backwards = b"".join(data[a : a + n] for a, n in spans[::-1])
    with MappedFile(path) as mapped:
        assert mapped.crcs(spans) == [zlib.crc32(data[a : a + n]) for a, n in spans]
        assert mapped.chain(spans) == zlib.crc32(joined)
        assert mapped.chain(spans[::-1]) == zlib.crc32(backwards)
        assert mapped.chain([]) == 0
    assert spans_crc(path, spans) == zlib.crc32(joined)
    assert spans_crc(path, spans[::-1]) == zlib.crc32(backwards)
    assert spans_crc(path, []) == 0
    # without ds-native's crc32_spans, span by span: the same values, chained or not
    each = [zlib.crc32(data[a : a + n]) for a, n in spans]
    assert _spans_each(data, spans) == each
    assert _spans_each(data, spans, chained=True)[-1] == zlib.crc32(joined)


def test_a_file_shorter_than_its_spans_is_named(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    short = pytest.raises(ValueError, match=f"{path.name} is shorter than its record")
    with MappedFile(path) as mapped, short:
        mapped.crcs([(0, 4), (len(data) - 2, 3)])
    with MappedFile(path) as mapped, short:
        mapped.chain([(0, 4), (len(data) - 2, 3)])
    empty = path.with_name("empty.pt")
    empty.write_bytes(b"")
    with MappedFile(empty) as mapped:
        assert mapped.crcs([(0, 0)]) == [0]
    with pytest.raises(ValueError, match="shorter than its record"):
        spans_crc(empty, [(0, 1)])


def test_one_mapping_serves_several_threads(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    runs = [[(i * 65_536, 65_536)] for i in range(40)]
    with MappedFile(path) as mapped:
        assert mapped.identity[2] == len(data) == mapped.size
        st = os.stat(path)
        assert mapped.identity == (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        results: dict[int, list[int]] = {}
        threads = [
            threading.Thread(target=lambda i=i: results.__setitem__(i, mapped.crcs(runs[i])))
            for i in range(len(runs))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [results[i] for i in range(len(runs))] == [
        [zlib.crc32(data[a : a + n]) for a, n in run] for run in runs
    ]


def test_a_pool_runs_a_job_here_as_a_finished_one() -> None:
    pool = HelpedPool(1)
    done = pool.run_here(lambda a, b: a + b, 2, 3)
    assert done.done() and pool.result(done) == 5
    failed = pool.run_here(lambda: 1 // 0)
    with pytest.raises(ZeroDivisionError):
        failed.result()
    ran = threading.Event()
    pool.later(ran.set)
    assert ran.wait(10)
    pool.shutdown()


def test_the_page_cache_probe_tells_cached_bytes_from_dropped_ones(
    data_file: tuple[Path, bytes],
) -> None:
    """A file just written and read is in the page cache; once its pages are dropped
    (``POSIX_FADV_DONTNEED`` after an fsync) it is not, and the probe says so without
    reading it in."""
    path, data = data_file
    path.read_bytes()
    offsets = [0, len(data) // 2, len(data) - 1]
    if not in_page_cache(path, offsets):
        pytest.skip("this platform or filesystem cannot tell (no RWF_NOWAIT reads)")
    drop_cached_pages(path)
    assert not in_page_cache(path, offsets)
    assert not in_page_cache(path, offsets)  # probing read nothing in
    assert not in_page_cache(path.with_name("absent.pt"), [0])
    # A probe that misses may start the kernel's read-ahead, whose pages a drop leaves while
    # they are read: read the file whole first, so that none is in flight.
    path.read_bytes()
    assert not on_disk(path)
    drop_cached_pages(path)
    assert on_disk(path)  # a dropped file's first byte is known to be on the disk
    assert not on_disk(path.with_name("absent.pt"))  # nothing known: not said to be on disk


def test_a_file_hashed_ahead_is_split_into_few_jobs() -> None:
    """One job a thread, none under _AHEAD_JOB: a 10M-parameter shard's 40 MiB of masters is
    one job on any host, 380 MiB is a job a thread on an 8-thread host, and every span is in
    exactly one job, in order."""
    mib = 1 << 20
    small = [(i * 2 * mib, 2 * mib) for i in range(20)]  # 40 MiB in 2 MiB tensors
    assert ahead_jobs(small, threads=8) == [small]
    assert ahead_jobs(small, threads=1) == [small]
    big = [(i * 4 * mib, 4 * mib) for i in range(95)]  # 380 MiB in 4 MiB tensors
    for threads, expected in ((8, 8), (4, 4), (1, 1), (16, 8)):
        jobs = ahead_jobs(big, threads)
        assert len(jobs) == expected
        assert [span for job in jobs for span in job] == big
        assert all(sum(n for _, n in job) >= _AHEAD_JOB for job in jobs[:-1])
    assert ahead_jobs([], threads=8) == []


def test_a_job_taken_over_or_dropped_lets_go_of_its_arguments_at_once() -> None:
    """A job still queued when the waiting thread takes it over (or the pool is shut down)
    holds its arguments no longer: a copy buffer they view can be kept for the next load
    before a thread takes the cancelled job off the queue."""
    import weakref

    class Arg:
        pass

    pool = HelpedPool(1)
    busy, free = threading.Event(), threading.Event()
    first = pool.submit(lambda: (busy.set(), free.wait(10)))  # the one thread is held
    assert busy.wait(10)
    taken_arg, dropped_arg = Arg(), Arg()
    taken_ref, dropped_ref = weakref.ref(taken_arg), weakref.ref(dropped_arg)
    taken = pool.submit(lambda a: type(a).__name__, taken_arg)
    dropped = pool.submit(lambda a: None, dropped_arg)
    del taken_arg, dropped_arg
    pool.help([taken])  # runs here; still in the executor's queue, cancelled
    assert pool.result(taken) == "Arg"
    assert taken_ref() is None
    stopper = threading.Thread(target=pool.shutdown)  # drops `dropped`, waits for `first`
    stopper.start()
    deadline = time.monotonic() + 5
    while dropped_ref() is not None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert dropped.cancelled() and dropped_ref() is None
    free.set()
    stopper.join(10)
    assert first.done()


def test_a_job_taken_over_gives_its_result_each_time_it_is_asked() -> None:
    """A job the waiting thread ran (its queued future cancelled) answers every ``result`` call,
    as a future does: a verdict that asks for a file's checksums after a caller already did
    got ``CancelledError`` (the flake of ds-engine's
    ``test_a_shard_replaced_after_it_was_hashed_is_checked_again`` on a busy machine)."""
    pool = HelpedPool(1)
    busy, free = threading.Event(), threading.Event()
    first = pool.submit(lambda: (busy.set(), free.wait(10)))  # the one thread is held
    assert busy.wait(10)
    queued = pool.submit(lambda: [7, 8])
    assert pool.result(queued) == [7, 8]  # not started: taken over, run here
    assert pool.result(queued) == [7, 8]
    free.set()
    assert first.result(timeout=10) == (None, True)
    pool.shutdown()


def _copy_kernel() -> None:
    from ds_zero._checksums import COPY_KERNEL

    if not COPY_KERNEL:
        pytest.skip("ds-native's Crc32CopyJob is not built")


def test_a_copy_job_copies_each_span_into_its_destination(data_file: tuple[Path, bytes]) -> None:
    """Spans bound for two destinations: each copied where its destination's offsets say,
    and the CRC-32s in the order of the spans."""
    import torch

    _copy_kernel()
    path, data = data_file
    spans = [(0, 100), (4096, 300), (70000, 64), (1 << 20, 4000)]
    first, second = torch.zeros(8192, dtype=torch.uint8), torch.zeros(5000, dtype=torch.uint8)
    places = [(first, [0, 2], [64, 1024]), (second, [1, 3], [0, 400])]
    with MappedFile(path) as mapped:
        job = mapped.copy_job(spans, places)
        job.run()
        assert job.crcs() == [zlib.crc32(data[a : a + n]) for a, n in spans]
    for out, indices, at in places:
        for i, offset in zip(indices, at):
            start, length = spans[i]
            assert bytes(out[offset : offset + length].tolist()) == data[start : start + length]


@pytest.mark.parametrize("threads_run", [True, False])
def test_a_shared_copy_is_finished_by_the_loader_whether_or_not_a_thread_ran(
    data_file: tuple[Path, bytes], threads_run: bool
) -> None:
    """The loader asking for a copied file's CRC-32s copies what no thread has: all of it when
    the thread never started (its job then cancelled), the rest when one is copying."""
    import torch

    from ds_zero._read_checks import shared_copy

    _copy_kernel()
    path, data = data_file
    spans = [(i * 30_000, 30_000) for i in range(100)]
    out = torch.zeros(3_000_000, dtype=torch.uint8)
    pool = HelpedPool(threads=3)
    if not threads_run:  # the threads are busy with a job that waits
        free = threading.Event()
        busy = [pool.submit(free.wait) for _ in range(3)]
    with MappedFile(path) as mapped:
        job = shared_copy(pool, mapped, spans, [(out, range(100), [a for a, _ in spans])], 3)
        assert pool.result(job) == [zlib.crc32(data[a : a + n]) for a, n in spans]
        if not threads_run:
            free.set()
            assert all(b.result(timeout=10) for b in busy)
        pool.shutdown()
    assert bytes(out.numpy()) == data[:3_000_000]


def test_a_thread_copies_a_whole_file_while_the_loader_holds_the_gil(tmp_path: Path) -> None:
    """The thread copying a file takes the GIL back only when no span is left (one native call,
    not one job of a few spans after another): a loader holding the GIL meanwhile, as one
    unpickling does, does not stop it. Once the first span is copied, the test holds the GIL in
    a busy loop (no switch for 10 s) until the last one is; 8 MiB jobs (before) stalled at the
    first job's end."""
    import torch

    from ds_zero._read_checks import shared_copy

    _copy_kernel()
    path = tmp_path / "model.pt"
    path.write_bytes(bytes([1]) * (40 << 20))
    spans = [(i << 20, 1 << 20) for i in range(40)]
    out = torch.zeros(40 << 20, dtype=torch.uint8)
    last = out.numpy()  # read without torch, whose calls release the GIL
    pool = HelpedPool(threads=1)
    pool.result(pool.submit(int))  # the thread is up
    old = sys.getswitchinterval()
    with MappedFile(path) as mapped:
        sys.setswitchinterval(10.0)
        try:
            job = shared_copy(pool, mapped, spans, [(out, range(40), [a for a, _ in spans])], 1)
            deadline = time.perf_counter() + 5.0
            while last[(1 << 20) - 1] == 0 and time.perf_counter() < deadline:
                time.sleep(1e-4)  # lets the GIL go: the thread starts, and copies a first span
            while last[-1] == 0 and time.perf_counter() < deadline:
                pass  # holds the GIL
            copied = bool(last[-1] == 1)
        finally:
            sys.setswitchinterval(old)
        pool.result(job)
        pool.shutdown()
    assert copied


def test_a_shared_copy_of_a_file_shorter_than_its_spans_fails_when_asked(
    data_file: tuple[Path, bytes],
) -> None:
    """Not when the copying is set up (on the loader's path, before its read): its result is
    the error, as a hashing job's is, told at the verdict."""
    import torch

    from ds_zero._read_checks import shared_copy

    _copy_kernel()
    path, data = data_file
    out = torch.zeros(100, dtype=torch.uint8)
    pool = HelpedPool(threads=1)
    with MappedFile(path) as mapped:
        job = shared_copy(pool, mapped, [(len(data) - 10, 100)], [(out, [0], [0])], 1)
        with pytest.raises(ValueError, match=f"{path.name} is shorter than its record"):
            pool.result(job)
    pool.shutdown()
