"""ds_native.crc32: zlib's CRC-32 values on every code path, any buffer, forced paths, errors."""

from __future__ import annotations

import array
import ctypes
import importlib.util
import mmap
import random
import re
import threading
import zlib
from pathlib import Path
from types import ModuleType

import pytest

import ds_native
from ds_native import _crc32, _ext
from ds_native._ext import NativeExtension
from ds_native.api import Crc32Simd

ROOT = Path(__file__).resolve().parents[1]
_ALL_PATHS: tuple[Crc32Simd, ...] = ("scalar", "pclmul", "vpclmul")
PATHS = [s for s in _ALL_PATHS if ds_native.crc32_simd_supported(s)]
needs_native = pytest.mark.skipif(not ds_native.native_available(), reason="no C extension")


def _constants_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "crc32_constants", ROOT / "tools/crc32_constants.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_constants_in_c_source_are_the_derived_ones() -> None:
    tool = _constants_tool()
    source = (ROOT / "csrc/crc32.c").read_text()
    for distance in tool.FOLD_BYTES:
        k_low, k_high = tool.fold_constants(distance)
        for half, k in (("LOW", k_low), ("HIGH", k_high)):
            match = re.search(rf"#define CRC_K{distance}_{half} (0x[0-9a-f]+)ULL", source)
            assert match is not None, (distance, half)
            assert int(match.group(1), 16) == k, (distance, half)


def test_python_model_of_folding_equals_zlib() -> None:
    tool = _constants_tool()
    rng = random.Random(1)
    for n in (16, 17, 48, 64, 65, 255, 1000):
        data = rng.randbytes(n)
        assert tool.model_crc32(data, 0xDEADBEEF) == zlib.crc32(data, 0xDEADBEEF)


@needs_native
def test_all_paths_available_here_include_scalar() -> None:
    assert PATHS[0] == "scalar"
    assert _crc32.default_crc32_simd() == PATHS[-1]


@pytest.mark.parametrize("simd", PATHS)
def test_small_lengths_unaligned_and_chained(simd: Crc32Simd) -> None:
    rng = random.Random(simd)
    buf = rng.randbytes(300 + 64 + 8)
    for n in range(301):
        for offset in (0, 1, 7):
            view = memoryview(buf)[offset : offset + n]
            expected = zlib.crc32(view)
            assert ds_native.crc32(view, simd=simd) == expected, (n, offset)
        value = rng.getrandbits(32)
        chunk = memoryview(buf)[3 : 3 + n]
        assert ds_native.crc32(chunk, value, simd=simd) == zlib.crc32(chunk, value)


@pytest.mark.parametrize("simd", PATHS)
def test_large_random_sizes_and_chaining(simd: Crc32Simd) -> None:
    rng = random.Random(7)
    data = rng.randbytes(3 << 20)
    view = memoryview(data)
    for _ in range(6):
        start = rng.randrange(0, 4096)
        n = rng.randrange(1 << 16, len(data) - start)
        piece = view[start : start + n]
        assert ds_native.crc32(piece, simd=simd) == zlib.crc32(piece)
        cut = rng.randrange(0, n)
        first = ds_native.crc32(piece[:cut], simd=simd)
        assert ds_native.crc32(piece[cut:], first, simd=simd) == zlib.crc32(piece)


def test_buffers_of_every_kind(tmp_path: Path) -> None:
    data = bytes(range(256)) * 1000
    assert ds_native.crc32(data) == zlib.crc32(data)
    assert ds_native.crc32(bytearray(data)) == zlib.crc32(data)
    floats = array.array("f")
    floats.frombytes(data)
    assert ds_native.crc32(floats) == zlib.crc32(data)
    assert ds_native.crc32(memoryview(floats).cast("B")[3:]) == zlib.crc32(data[3:])
    c_buffer = (ctypes.c_char * len(data)).from_buffer_copy(data)
    assert ds_native.crc32(c_buffer) == zlib.crc32(data)
    path = tmp_path / "blob"
    path.write_bytes(data)
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        assert ds_native.crc32(memoryview(mapped)[5:]) == zlib.crc32(data[5:])


def test_value_keeps_low_32_bits_like_zlib() -> None:
    for value in (-1, 2**32 + 1, 2**40, 0xFFFFFFFF):
        assert ds_native.crc32(b"abc", value) == zlib.crc32(b"abc", value)
    assert ds_native.crc32(b"") == 0


def test_rejects_non_buffers_and_strided_views() -> None:
    with pytest.raises(TypeError):
        ds_native.crc32("text")  # type: ignore[arg-type]
    with pytest.raises(BufferError):
        ds_native.crc32(memoryview(bytes(8))[::2])


@needs_native
def test_env_var_forces_path_and_bad_values_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_crc32.SIMD_ENV, "scalar")
    assert _crc32.default_crc32_simd() == "scalar"
    assert ds_native.crc32(b"x" * 1000) == zlib.crc32(b"x" * 1000)
    monkeypatch.setenv(_crc32.SIMD_ENV, "avx9")
    with pytest.raises(ValueError, match=r"\$DS_NATIVE_CRC32_SIMD must be one of"):
        ds_native.crc32(b"x")
    with pytest.raises(ValueError, match="simd must be one of"):
        ds_native.crc32(b"x", simd="sse")  # type: ignore[arg-type]


class _CpuWithout:
    """The loaded extension, claiming the CPU cannot run the given code path."""

    def __init__(self, lib: object, missing: int) -> None:
        self._lib = lib
        self._missing = missing

    def ds_native_crc32_simd_supported(self, simd: int) -> int:
        return 0 if simd == self._missing else self._lib.ds_native_crc32_simd_supported(simd)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._lib, name)


@needs_native
def test_forcing_a_path_the_cpu_lacks_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = _CpuWithout(_ext.EXTENSION.lib, missing=3)
    monkeypatch.setattr(_ext, "EXTENSION", NativeExtension(ffi=_ext.EXTENSION.ffi, lib=lib))
    with pytest.raises(ValueError, match="'vpclmul' cannot run on this CPU"):
        ds_native.crc32(b"x", simd="vpclmul")


class _CpuWithoutClmul:
    """The loaded extension on a CPU with neither carry-less-multiply path."""

    def __init__(self, lib: object) -> None:
        self._lib = lib
        self.kernel_calls = 0

    def ds_native_crc32_simd_supported(self, simd: int) -> int:
        return int(simd == 1)

    def ds_native_crc32_auto_simd(self) -> int:
        return 1

    def ds_native_crc32(self, *args: object) -> int:
        self.kernel_calls += 1
        return self._lib.ds_native_crc32(*args)  # type: ignore[attr-defined]


@needs_native
def test_without_clmul_zlib_runs_unless_scalar_is_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = _CpuWithoutClmul(_ext.EXTENSION.lib)
    monkeypatch.setattr(_ext, "EXTENSION", NativeExtension(ffi=_ext.EXTENSION.ffi, lib=lib))
    data = bytes(range(256)) * 40
    assert ds_native.crc32(data, 11) == zlib.crc32(data, 11)
    assert lib.kernel_calls == 0
    assert ds_native.crc32(data, 11, simd="scalar") == zlib.crc32(data, 11)
    assert lib.kernel_calls == 1
    with pytest.raises(ValueError, match="'pclmul' cannot run on this CPU"):
        ds_native.crc32(data, simd="pclmul")


def test_without_extension_falls_back_to_zlib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_ext, "EXTENSION", NativeExtension(unavailable_reason="not built (test)"))
    assert ds_native.crc32(b"hello", 3) == zlib.crc32(b"hello", 3)
    assert _crc32.default_crc32_simd() is None
    assert not ds_native.crc32_simd_supported("scalar")


@needs_native
def test_concurrent_callers_agree() -> None:
    data = random.Random(3).randbytes(8 << 20)
    expected = zlib.crc32(data)
    results: list[int] = []

    def work() -> None:
        results.append(ds_native.crc32(data))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [expected] * 4


# --- crc32_spans ---------------------------------------------------------------------------------


def _random_spans(rng: random.Random, size: int, count: int) -> list[tuple[int, int]]:
    spans = []
    for _ in range(count):
        start = rng.randrange(size + 1)
        spans.append((start, rng.randrange(size - start + 1)))
    return spans


@pytest.mark.parametrize("simd", [None, *PATHS])
def test_spans_equal_zlib_per_span_and_chained(simd: Crc32Simd | None) -> None:
    rng = random.Random(7)
    data = rng.randbytes(300_000)
    spans = [*_random_spans(rng, len(data), 40), (0, len(data)), (len(data), 0), (5, 0)]
    each = ds_native.crc32_spans(data, spans, simd=simd)
    assert each == [zlib.crc32(data[a : a + n]) for a, n in spans]
    chained = ds_native.crc32_spans(data, spans, chained=True, simd=simd)
    assert chained[-1] == zlib.crc32(b"".join(data[a : a + n] for a, n in spans))
    assert chained == [
        zlib.crc32(b"".join(data[a : a + n] for a, n in spans[: i + 1])) for i in range(len(spans))
    ]


def test_spans_read_any_buffer_in_place(tmp_path: Path) -> None:
    data = random.Random(8).randbytes(1 << 20)
    path = tmp_path / "f"
    path.write_bytes(data)
    spans = [(4096, 100_000), (1, 2), (500_000, 524_288)]
    expected = [zlib.crc32(data[a : a + n]) for a, n in spans]
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        with memoryview(mapped) as view:
            assert ds_native.crc32_spans(view, spans) == expected
        mapped.close()  # no export left behind
    floats = array.array("f", range(1000))
    assert ds_native.crc32_spans(floats, [(8, 400)]) == [zlib.crc32(floats.tobytes()[8:408])]
    assert ds_native.crc32_spans(bytearray(data), []) == []


@pytest.mark.parametrize("span", [(-1, 4), (0, -1), (10, 1), (11, 0), (3, 8)])
def test_spans_leaving_the_buffer_are_refused_naming_the_span(span: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match=re.escape(f"span (start, length) {span} leaves")):
        ds_native.crc32_spans(b"0123456789", [(0, 2), span])


def test_spans_without_extension_fall_back_to_zlib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_ext, "EXTENSION", NativeExtension(unavailable_reason="not built (test)"))
    data = b"hello, spans"
    spans = [(0, 5), (7, 5)]
    assert ds_native.crc32_spans(data, spans) == [zlib.crc32(b"hello"), zlib.crc32(b"spans")]
    assert ds_native.crc32_spans(data, spans, chained=True)[-1] == zlib.crc32(b"hellospans")
