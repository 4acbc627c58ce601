"""Public types of ds_native."""

from __future__ import annotations

from typing import Literal, TypedDict

Backend = Literal["native", "torch"]
"""Which implementation a dispatcher runs: the C kernel or the torch reference."""

SimdLevel = Literal["avx512", "avx2", "neon", "scalar"]
"""Widest SIMD instruction set the running CPU (and OS) supports, as the kernels will use it."""


AdamSimd = Literal["avx512", "avx2", "scalar"]
"""Code path of the CPU-Adam kernel: AVX-512 (F/BW/VL), AVX2 (+FMA, F16C), or portable C."""

Crc32Simd = Literal["vpclmul", "pclmul", "scalar"]
"""Code path of ``crc32``: AVX-512 VPCLMULQDQ, PCLMULQDQ (+SSE4.1), or table-driven C."""


class BuildInfo(TypedDict):
    """What ``ds_native.build_info()`` reports about the C extension."""

    available: bool
    """Whether the C extension loaded; when False the dispatchers use the torch references."""
    reason: str | None
    """Why the extension is unavailable (None when it is available)."""
    simd_level: SimdLevel | None
    """SIMD level of the running CPU, from ``__builtin_cpu_supports`` (None without extension)."""
    compiled_simd: str | None
    """Instruction set the compiler targeted for the baseline code (e.g. ``"sse2"``)."""
    compiler: str | None
    """Compiler that built the extension, e.g. ``"gcc 12.2.0"``."""
    compile_args: list[str] | None
    """Extra compile arguments the extension was built with."""
    adam_simd: AdamSimd | None
    """Code path ``adam_step`` runs by default here: the widest the CPU supports, unless
    ``$DS_NATIVE_ADAM_SIMD`` forces one (None without the extension)."""


class NativeFallbackWarning(RuntimeWarning):
    """Issued once per process when a native kernel is requested but the C extension is missing."""
