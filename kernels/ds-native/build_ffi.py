"""cffi builder for ds_native's C kernels, run by setup.py (``cffi_modules``) at build time only.

Adding a kernel: put ``csrc/<kernel>.c`` next to the others and declare its functions in
``csrc/ds_native.h``; every ``csrc/*.c`` is compiled into the one extension module.

Paths are relative to the distribution root, which is the working directory of every build
(setuptools runs setup.py from there; cffi executes this file without setting ``__file__``).
"""

from __future__ import annotations

import json
from pathlib import Path

import cffi

CSRC = Path("csrc")
HEADER = CSRC / "ds_native.h"
MODULE = "ds_native._ds_native_cffi"

# -fno-math-errno lets sqrtf become a single vector instruction (the Adam update needs it). No
# -march: the wheel must run on any CPU of its architecture; wider ISAs come through per-function
# target attributes and ds_native_simd_level() at run time.
COMPILE_ARGS = ["-O3", "-fno-math-errno", "-pthread"]
# The parallel kernels run on a small pthread pool (csrc/thread_pool.c), not OpenMP: see
# [Note: thread pool] there.
LINK_ARGS = ["-pthread"]


def _declarations(header: Path) -> str:
    """The header without preprocessor lines, which cffi's cdef parser rejects."""
    lines = header.read_text().splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith("#"))


_PREAMBLE = f"""
#include "ds_native.h"

const char *ds_native_compile_args(void) {{ return {json.dumps(" ".join(COMPILE_ARGS))}; }}
"""

ffibuilder = cffi.FFI()
ffibuilder.cdef(_declarations(HEADER))
ffibuilder.set_source(
    MODULE,
    _PREAMBLE,
    sources=[p.as_posix() for p in sorted(CSRC.glob("*.c"))],
    include_dirs=[CSRC.as_posix()],
    depends=[p.as_posix() for p in sorted(CSRC.glob("*.h"))],
    extra_compile_args=COMPILE_ARGS,
    extra_link_args=LINK_ARGS,
    optional=True,  # see [Note: optional native build] in setup.py
)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir="build", verbose=True)
