"""ds-native: C kernels built through cffi at install time, each with a torch reference.

Every kernel is a dispatcher that runs the C kernel on contiguous CPU tensors of the dtypes it
supports and the torch reference otherwise, including when the package was installed without a
C compiler (then it warns once, with ``NativeFallbackWarning``).
"""

from __future__ import annotations

from ds_native._adam import adam_step, adam_step_reference
from ds_native._axpy import axpy, axpy_reference
from ds_native._crc32 import crc32, crc32_simd_supported, crc32_spans
from ds_native._crc32_copy import Crc32CopyJob, crc32_copy_spans
from ds_native._ext import build_info, native_available, simd_level
from ds_native._stream import (
    stream_adam_traffic,
    stream_adam_traffic_reference,
    stream_triad,
    stream_triad_reference,
)
from ds_native.api import (
    AdamSimd,
    Backend,
    BuildInfo,
    Crc32Simd,
    NativeFallbackWarning,
    SimdLevel,
)

__version__ = "0.2.0"

__all__ = [
    # kernels, each with its torch reference
    "axpy",
    "axpy_reference",
    "adam_step",
    "adam_step_reference",
    "stream_triad",
    "stream_triad_reference",
    "stream_adam_traffic",
    "stream_adam_traffic_reference",
    # checksums (zlib's CRC-32, same values)
    "crc32",
    "Crc32CopyJob",
    "crc32_copy_spans",
    "crc32_simd_supported",
    "crc32_spans",
    # build and CPU introspection
    "native_available",
    "build_info",
    "simd_level",
    # types
    "AdamSimd",
    "Backend",
    "BuildInfo",
    "Crc32Simd",
    "NativeFallbackWarning",
    "SimdLevel",
    "__version__",
]
