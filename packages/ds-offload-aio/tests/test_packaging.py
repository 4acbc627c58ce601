"""The sdist builds a wheel with the libaio engine, and without a compiler a wheel that still works.

Builds run offline without build isolation, so they need the ``test`` dependency group (pip,
setuptools, cffi). Each wheel is installed into its own target and checked in a fresh interpreter.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest

_NEEDS = [m for m in ("pip", "setuptools", "cffi") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(_NEEDS), reason=f"needs the test group ({_NEEDS} missing)")

ROOT = Path(__file__).resolve().parents[1]
NO_COMPILER = "/nonexistent-cc"

# In the installed copy: which backend, a round trip, and the warnings it raised.
_CHECK = """
import json, sys, warnings, torch
import ds_offload_aio as aio
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for _ in range(2):
        with aio.AioHandle() as handle:
            data = torch.arange(10_001, dtype=torch.int32)
            handle.sync_pwrite(data, sys.argv[1])
            back = torch.empty_like(data)
            handle.sync_pread(back, sys.argv[1])
print(json.dumps({"file": aio.__file__, "info": aio.backend_info(), "ok": torch.equal(back, data),
                  "warnings": [(w.category.__name__, str(w.message)) for w in caught]}))
"""


def _run(args: list[Any], cwd: Path, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{args}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("src") / "ds-offload-aio"
    artifacts = ("build", "dist", "*.egg-info", "__pycache__", "*.so", "_build_error.txt")
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*artifacts))
    out = tmp_path_factory.mktemp("sdist")
    _run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
          "b.build_sdist(sys.argv[1])", out], cwd=source)  # fmt: skip
    (path,) = out.glob("ds_offload_aio-*.tar.gz")
    return path


def _wheel_and_check(
    sdist: Path, tmp_path: Path, env: dict[str, str]
) -> tuple[str, set[str], dict]:
    log = _run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                "--no-index", "--no-cache-dir", "-w", tmp_path / "w", sdist], tmp_path, env)  # fmt: skip
    (wheel,) = (tmp_path / "w").glob("ds_offload_aio-*.whl")
    site = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", site,
          wheel], tmp_path)  # fmt: skip
    check_env = {**os.environ, "PYTHONPATH": str(site)}
    report = json.loads(
        _run([sys.executable, "-c", _CHECK, tmp_path / "io.bin"], tmp_path, check_env)
    )
    assert Path(report["file"]).is_relative_to(site)
    assert report["ok"] is True
    return log, set(zipfile.ZipFile(wheel).namelist()), report


def test_sdist_ships_the_c_engine_and_build_scripts(sdist: Path) -> None:
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"setup.py", "build_ffi.py", "pyproject.toml", "csrc/ds_aio.c", "csrc/ds_aio.h",
            "src/ds_offload_aio/py.typed"} <= names  # fmt: skip
    assert not any(n.endswith((".so", ".o", "_build_error.txt")) for n in names)


@pytest.mark.slow  # every test session installs a wheel built with the compiler already
def test_wheel_with_compiler_uses_libaio(sdist: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    _, names, report = _wheel_and_check(sdist, tmp_path, env)
    assert any(n.startswith("ds_offload_aio/_aio_cffi") for n in names)
    assert report["info"] == {"backend": "libaio", "reason": None}
    assert report["warnings"] == []


def test_wheel_without_compiler_installs_and_uses_threads(sdist: Path, tmp_path: Path) -> None:
    log, names, report = _wheel_and_check(sdist, tmp_path, {**os.environ, "CC": NO_COMPILER})
    assert "the libaio engine was not built" in log
    assert "ds_offload_aio/_build_error.txt" in names
    assert not any(n.startswith("ds_offload_aio/_aio_cffi") for n in names)
    assert report["info"]["backend"] == "threads"
    assert NO_COMPILER in report["info"]["reason"]
    ((category, message),) = report["warnings"]
    assert category == "AioFallbackWarning"
    assert message.startswith("ds_offload_aio: libaio engine not built at install time (")
    assert "using the thread-pool backend" in message
