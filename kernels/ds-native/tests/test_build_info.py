"""build_info() and simd_level(): what was built and what the CPU supports."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

import ds_native
from ds_native import _ext
from ds_native._ext import NativeExtension


def test_extension_is_built() -> None:
    # Every test environment has a compiler: a missing extension there is a build regression.
    info = ds_native.build_info()
    assert ds_native.native_available(), info["reason"]
    assert info["available"] is True
    assert info["reason"] is None


def test_build_info_reports_compile_args_and_compiler() -> None:
    info = ds_native.build_info()
    assert info["compile_args"] is not None
    assert {"-O3", "-fno-math-errno"} <= set(info["compile_args"])
    assert not any(arg.startswith("-march") for arg in info["compile_args"])
    assert info["compiler"] and info["compiler"] != "unknown"
    assert info["compiled_simd"] in {"avx512", "avx2", "neon", "sse2", "scalar"}
    assert info["simd_level"] == ds_native.simd_level()


def _cpuinfo_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"),
    reason="reads x86 flags from /proc/cpuinfo",
)
def test_simd_level_matches_cpu_flags() -> None:
    flags = _cpuinfo_flags()
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        expected = "avx512"
    elif {"avx2", "fma"} <= flags:
        expected = "avx2"
    else:
        expected = "scalar"
    assert ds_native.simd_level() == expected


@pytest.mark.skipif(platform.machine() not in ("aarch64", "arm64"), reason="AArch64 only")
def test_simd_level_is_neon_on_aarch64() -> None:
    assert ds_native.simd_level() == "neon"


def test_build_info_without_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_ext, "EXTENSION", NativeExtension(unavailable_reason="no compiler"))
    assert not ds_native.native_available()
    assert ds_native.simd_level() is None
    assert ds_native.build_info() == {
        "available": False,
        "reason": "no compiler",
        "simd_level": None,
        "compiled_simd": None,
        "compiler": None,
        "compile_args": None,
        "adam_simd": None,
    }
