"""The built CPU-Adam kernel: reported code path, and vector sqrt/div in each path's machine code.

GCC keeps ``sqrtf`` a scalar libm call unless errno semantics are off (``-fno-math-errno``), which
would quietly make every path scalar-speed; the disassembly shows whether the build got it right.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from importlib import import_module

import pytest

import ds_native

_X86_LINUX = platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


def test_build_info_reports_the_adam_path() -> None:
    info = ds_native.build_info()
    assert info["adam_simd"] in ("avx512", "avx2", "scalar")
    assert "-fno-math-errno" in (info["compile_args"] or [])


def _functions(path: str) -> dict[str, list[str]]:
    """Instructions of each function symbol in the shared object at ``path``."""
    out = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", path], capture_output=True, text=True, check=True
    ).stdout
    functions: dict[str, list[str]] = {}
    current: list[str] = []
    for line in out.splitlines():
        header = re.match(r"^[0-9a-f]+ <([^>]+)>:$", line)
        if header:
            current = functions.setdefault(header.group(1).split(".")[0], [])
        elif "\t" in line:
            current.append(line.split("\t", 1)[1].strip())
    return functions


@pytest.mark.skipif(not _X86_LINUX or shutil.which("objdump") is None, reason="x86 + objdump")
def test_every_path_computes_sqrt_and_reciprocal_in_vectors() -> None:
    functions = _functions(import_module("ds_native._ds_native_cffi").__file__)
    if "adam_range_avx512" not in functions:
        pytest.skip("extension stripped of local symbols")

    def ops(name: str) -> str:
        return "\n".join(functions[name])

    # The vector paths divide by a refined reciprocal estimate, never vdivps ([Note: no division]
    # in csrc/adam.c: the divider, shared with sqrt, bound a single core).
    assert re.search(r"vsqrtps\s+%zmm", ops("adam_range_avx512"))
    assert re.search(r"vrcp14ps\s+%zmm", ops("adam_range_avx512"))
    assert not re.search(r"vdivps", ops("adam_range_avx512"))
    assert re.search(r"vsqrtps\s+%ymm", ops("adam_range_avx2"))
    assert re.search(r"vrcpps\s+%ymm", ops("adam_range_avx2"))
    assert not re.search(r"vdivps", ops("adam_range_avx2"))
    # The portable loop: packed SSE sqrt for float32 grads (16-bit conversions stay scalar).
    assert re.search(r"\bsqrtps\b", ops("adam_range_scalar"))
    assert not any("sqrtf" in insn for insns in functions.values() for insn in insns)
