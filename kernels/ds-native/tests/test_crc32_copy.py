"""ds_native.crc32_copy_spans: each span copied exactly to its destination and hashed as
copied, on every code path, into buffers and tensors; bad input refused with nothing copied."""

from __future__ import annotations

import array
import mmap
import random
import re
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest
import torch

import ds_native
from ds_native import _ext
from ds_native._ext import NativeExtension
from ds_native.api import Crc32Simd

_ALL_PATHS: tuple[Crc32Simd, ...] = ("scalar", "pclmul", "vpclmul")
PATHS = [s for s in _ALL_PATHS if ds_native.crc32_simd_supported(s)]
# spans shorter and longer than the kernel's 64 KiB block, one of several blocks plus a tail,
# overlapping and empty ones, in no order
SPANS = [(5, 3), (1000, 65_536), (70_000, 200_001), (0, 600_000), (9, 0), (300, 70_000)]


def _bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.view(torch.uint8).tolist())


def _crcs(data: bytes, spans: list[tuple[int, int]]) -> list[int]:
    return [zlib.crc32(data[a : a + n]) for a, n in spans]


@pytest.mark.parametrize("simd", [None, *PATHS])
def test_each_span_lands_in_its_buffer_with_its_zlib_crc(simd: Crc32Simd | None) -> None:
    data = random.Random(11).randbytes(600_000)
    outs = [bytearray(n + 3) for _, n in SPANS]  # room to spare: nothing written past a span
    assert ds_native.crc32_copy_spans(data, SPANS, outs, simd=simd) == _crcs(data, SPANS)
    for (a, n), out in zip(SPANS, outs):
        assert out == bytearray(data[a : a + n] + bytes(3))


@pytest.mark.parametrize("simd", [None, *PATHS])
def test_tensors_of_any_dtype_take_the_bytes(simd: Crc32Simd | None) -> None:
    data = random.Random(13).randbytes(1_200_000)
    source = torch.frombuffer(bytearray(data), dtype=torch.float32)
    spans = [(0, 400_000), (400_000, 800_000), (4, 8)]
    outs = [torch.empty(100_000), torch.empty(400_000, dtype=torch.bfloat16), torch.empty(8)]
    assert ds_native.crc32_copy_spans(data, spans, outs, simd=simd) == _crcs(data, spans)
    assert torch.equal(outs[0].view(torch.int32), source[:100_000].view(torch.int32))
    assert torch.equal(outs[1].view(torch.int32), source[100_000:300_000].view(torch.int32))
    assert _bytes(outs[2])[:8] == data[4:12]


def test_reads_a_mapping_and_writes_array_and_mmap_buffers(tmp_path: Path) -> None:
    data = random.Random(12).randbytes(1 << 20)
    (tmp_path / "f").write_bytes(data)
    spans = [(4096, 400_000), (1, 2), (600_000, 448_576)]
    outs = [array.array("f", bytes(400_000)), bytearray(2), mmap.mmap(-1, 448_576)]
    with open(tmp_path / "f", "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        with memoryview(m) as view:
            assert ds_native.crc32_copy_spans(view, spans, outs) == _crcs(data, spans)
        m.close()  # no export left behind
    assert [bytes(out) for out in outs] == [data[a : a + n] for a, n in spans]
    outs[2].close()  # nor on a destination
    assert ds_native.crc32_copy_spans(data, [], []) == []


@pytest.mark.parametrize("simd", [None, *PATHS])
def test_with_at_each_span_lands_at_its_offset_of_one_destination(simd: Crc32Simd | None) -> None:
    data = random.Random(14).randbytes(600_000)
    places = [0, 64, 65_600, 265_664, 865_728, 865_728]  # after each other, gaps between
    out = bytearray(1_000_000)
    got = ds_native.crc32_copy_spans(data, SPANS, out, at=places, simd=simd)
    assert got == _crcs(data, SPANS)
    for (a, n), place in zip(SPANS, places):
        assert out[place : place + n] == data[a : a + n]
    assert out[3:64] == bytes(61) and out[-10:] == bytes(10)  # nothing written between them
    tensor = torch.zeros(250_000, dtype=torch.float32)  # its bytes, whatever its dtype
    assert ds_native.crc32_copy_spans(data, SPANS, tensor, at=places, simd=simd) == got
    assert _bytes(tensor)[65_600 : 65_600 + 200_001] == data[70_000:270_001]


@pytest.mark.parametrize(
    ("at", "message"),
    [
        ([0, 8], "span 1 would go to bytes [8, 12) of the destination, which holds 10; pass"),
        ([-1, 0], "span 0 would go to bytes [-1, 2) of the destination"),
        ([0], "2 spans but 1 offsets in at; pass one each"),
    ],
)
def test_with_at_offsets_outside_the_destination_are_refused(at: list[int], message: str) -> None:
    out = bytearray(10)
    with pytest.raises(ValueError, match=re.escape(message)):
        ds_native.crc32_copy_spans(b"0123456789", [(0, 3), (5, 4)], out, at=at)
    assert out == bytearray(10)  # nothing copied


@pytest.mark.parametrize("span", [(-1, 4), (0, -1), (10, 1), (11, 0), (3, 8)])
def test_spans_leaving_the_source_are_refused_and_nothing_is_copied(
    span: tuple[int, int],
) -> None:
    outs = [bytearray(20), bytearray(20)]
    with pytest.raises(ValueError, match=re.escape(f"span (start, length) {span} leaves")):
        ds_native.crc32_copy_spans(b"0123456789", [(0, 2), span], outs)
    assert outs == [bytearray(20), bytearray(20)]


@pytest.mark.parametrize(
    ("outs", "message"),
    [
        ([bytearray(3), bytearray(3)], "span 1 holds 4 bytes, its destination only 3; pass one"),
        ([bytearray(3)], "2 spans but 1 destinations; pass one each"),
        ([bytearray(3), b"xxxx"], "destination 1 is read-only"),
        ([bytearray(3), torch.empty(8, dtype=torch.uint8)[::2]], "not contiguous; pass a"),
        ([bytearray(3), torch.empty(3, dtype=torch.uint8)], "span 1 holds 4 bytes"),
    ],
)
def test_bad_destinations_are_refused_saying_what_is_needed(outs: list, message: str) -> None:
    first = outs[0]
    with pytest.raises(ValueError, match=re.escape(message)):
        ds_native.crc32_copy_spans(b"0123456789", [(0, 3), (5, 4)], outs)
    assert first == bytearray(3)  # nothing copied


def test_without_extension_the_copies_and_crcs_come_from_python_and_zlib(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_ext, "EXTENSION", NativeExtension(unavailable_reason="not built (test)"))
    outs = [bytearray(5), torch.zeros(5, dtype=torch.uint8), torch.empty(0)]
    assert ds_native.crc32_copy_spans(b"hello, spans", [(0, 5), (7, 5), (3, 0)], outs) == [
        zlib.crc32(b"hello"),
        zlib.crc32(b"spans"),
        0,
    ]
    assert outs[0] == bytearray(b"hello")
    assert _bytes(outs[1]) == b"spans"
    one = torch.zeros(12, dtype=torch.uint8)
    got = ds_native.crc32_copy_spans(b"hello, spans", [(0, 5), (7, 5)], one, at=[6, 0])
    assert got == [zlib.crc32(b"hello"), zlib.crc32(b"spans")]
    assert _bytes(one) == b"spans\x00hello\x00"


@pytest.mark.skipif(not ds_native.native_available(), reason="no C extension")
def test_the_gil_is_released_while_copying() -> None:
    """Another thread runs Python while one call copies 256 MiB: it gets the GIL before the
    call returns, which it could not if the call held the GIL (it would then get it only
    after)."""
    data = bytes(32 << 20)
    out = bytearray(len(data))
    spans = [(0, len(data))] * 8  # one call, 8 passes over the same 32 MiB
    entered, returned = threading.Event(), []

    def copy() -> None:
        entered.set()
        ds_native.crc32_copy_spans(data, spans, [out] * len(spans))
        returned.append(time.perf_counter())

    worker = threading.Thread(target=copy)
    worker.start()
    entered.wait()  # wakes holding the GIL: once the call releases it, or once it returned
    ran = time.perf_counter()
    worker.join()
    assert ran < returned[0]


@pytest.fixture(params=["native", "python"])
def native_or_python(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C kernel, or the copies by Python and zlib (the extension made absent)."""
    if request.param == "python":
        monkeypatch.setattr(_ext, "EXTENSION", NativeExtension(unavailable_reason="test"))
    elif not ds_native.native_available():
        pytest.skip("no C extension")


@pytest.mark.usefixtures("native_or_python")
def test_a_job_run_by_several_threads_copies_each_span_once_with_its_crc() -> None:
    """Four threads and the caller run one job: every span lands at its offset with zlib's
    CRC-32, whoever took it; a run after the others have taken every span returns at once."""
    data = random.Random(21).randbytes(3_000_000)
    spans = [(i * 29_989, 29_989 + i % 7) for i in range(90)]
    places = [sum(n for _, n in spans[:i]) for i in range(len(spans))]
    out = torch.zeros(sum(n for _, n in spans), dtype=torch.uint8)
    with ds_native.Crc32CopyJob(data, spans, out, at=places) as job:
        helpers = [threading.Thread(target=job.run) for _ in range(4)]
        for helper in helpers:
            helper.start()
        job.run()
        for helper in helpers:
            helper.join()
        job.run()  # nothing left
        crcs = job.crcs()
    assert crcs == _crcs(data, spans)
    assert _bytes(out) == b"".join(data[a : a + n] for a, n in spans)
    assert job.crcs() == crcs  # still answers once closed


@pytest.mark.usefixtures("native_or_python")
def test_a_stopped_job_leaves_the_spans_not_yet_taken_uncopied() -> None:
    data = random.Random(22).randbytes(1000)
    outs = [bytearray(10) for _ in range(3)]
    with ds_native.Crc32CopyJob(data, [(0, 10), (10, 10), (20, 10)], outs) as job:
        job.stop()
        job.run()
        assert job.crcs() == [0, 0, 0]
    assert outs == [bytearray(10)] * 3


def test_a_job_checks_its_arguments_as_crc32_copy_spans_does() -> None:
    with pytest.raises(ValueError, match=r"span \(start, length\) \(2, 5\) leaves the 3-byte"):
        ds_native.Crc32CopyJob(b"abc", [(0, 1), (2, 5)], [bytearray(1), bytearray(5)])
    with pytest.raises(ValueError, match="2 spans but 1 offsets in at"):
        ds_native.Crc32CopyJob(b"abc", [(0, 1), (1, 1)], bytearray(2), at=[0])


@pytest.mark.skipif(not ds_native.native_available(), reason="no C extension")
def test_a_job_takes_the_gil_back_only_when_no_span_is_left() -> None:
    """The thread that runs a job takes the GIL back once, at its end: another thread that
    holds the GIL meanwhile (a loader unpickling) does not stop it between spans. Here the main
    thread holds the GIL in a busy Python loop until the job's spans are all copied (it reads
    the copies' last byte, which the GIL-free run writes); if the run needed the GIL between
    spans, it would stall until the loop's switch interval ran out (a loop of one-span calls
    does: checked)."""
    spans = [(i << 20, 1 << 20) for i in range(64)]
    data = bytes([1]) * (64 << 20)
    out = bytearray(64 << 20)  # read in Python, holding the GIL (torch's calls release it)
    places = [a for a, _ in spans]
    old = sys.getswitchinterval()
    sys.setswitchinterval(10.0)  # the GIL changes hands only when its holder gives it up
    try:
        with ds_native.Crc32CopyJob(data, spans, out, at=places) as job:
            helper = threading.Thread(target=job.run)
            helper.start()
            deadline = time.perf_counter() + 5.0
            while out[-1] == 0 and time.perf_counter() < deadline:
                pass  # holds the GIL: no switch for 10 s
            copied = out[-1] == 1
            helper.join()
    finally:
        sys.setswitchinterval(old)
    assert copied
