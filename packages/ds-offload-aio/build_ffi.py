"""cffi builder (API mode) for the libaio engine; setup.py runs it at build time only.

Paths are relative to the distribution root, the working directory of every build.
"""

from __future__ import annotations

from pathlib import Path

import cffi

HEADER = Path("csrc/ds_aio.h")

ffibuilder = cffi.FFI()
# cffi's cdef parser takes declarations only: drop the include guard and #include lines.
ffibuilder.cdef(
    "\n".join(line for line in HEADER.read_text().splitlines() if not line.startswith("#"))
)
ffibuilder.set_source(
    "ds_offload_aio._aio_cffi",
    '#include "ds_aio.h"',
    sources=["csrc/ds_aio.c"],
    include_dirs=["csrc"],
    depends=[HEADER.as_posix()],
    libraries=["aio"],
    extra_compile_args=["-O2"],
    optional=True,  # see [Note: libaio is optional] in setup.py
)
