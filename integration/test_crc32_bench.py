"""tools/bench/crc32.py runs end to end as its docstring runs it (tiny sizes), printing a row per
contender and what hashing adds to the copy; bad sizes are refused."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from _bench_run import run_bench


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return run_bench("crc32.py", *args)


def _clmul() -> bool:
    """Whether this CPU runs ds-native's carry-less-multiply CRC-32 (the bench names it)."""
    try:
        import ds_native
    except ImportError:
        return False
    return ds_native.native_available() and ds_native.crc32_simd_supported("pclmul")


def test_a_row_per_contender_and_the_added_cost() -> None:
    proc = _bench("--mb", "1", "--tensors", "3", "--repeats", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = dict(re.findall(r"^\| ([^|]+?) \| ([0-9.]+) \| [0-9.]+ \|$", proc.stdout, re.M))
    # with the C extension on a CPU with carry-less multiplies, the widest path named too
    named = {row for row in rows if row.startswith("ds_native.crc32_spans, simd=")}
    assert len(named) == (1 if "C extension built" in proc.stdout and _clmul() else 0), rows
    assert set(rows) - named == {
        "zlib.crc32, each span",
        "ds_native.crc32_spans",
        "copy (torch copy_)",
        "ds_native.crc32_copy_spans",
        "ds_native.crc32_copy_spans, one buffer (at=)",
    }, proc.stdout
    assert all(float(ms) > 0 for ms in rows.values())
    assert "1.0 MB in 3 spans, median of 2 rounds" in proc.stdout
    assert re.search(r"hashing while copying adds [-+][0-9.]+ ms to the copy", proc.stdout)


def test_bad_sizes_are_refused() -> None:
    proc = _bench("--tensors", "0")
    assert proc.returncode == 2 and "--tensors 0" in proc.stderr, proc.stderr
