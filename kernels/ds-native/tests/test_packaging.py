"""The distribution builds from its sdist, with a C compiler and without one.

Builds run offline, without build isolation, so the test environment needs pip, setuptools and
cffi (the ``test`` dependency group). Each installed copy is checked in a fresh interpreter.
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

# find_spec, not import: importing setuptools here would clash with an already imported distutils.
_MISSING = [m for m in ("pip", "setuptools", "cffi") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(
    bool(_MISSING), reason=f"needs the test dependency group (missing: {', '.join(_MISSING)})"
)

DIST_ROOT = Path(__file__).resolve().parents[1]
NO_COMPILER = "/nonexistent-cc"

# Run in the installed copy: axpy twice (the fallback must warn once) and report.
_CHECK = """
import json, warnings
import torch
import ds_native
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    y = torch.ones(5)
    ds_native.axpy(2.0, torch.arange(5.0), y)
    ds_native.axpy(2.0, torch.arange(5.0), y)
print(json.dumps({
    "file": ds_native.__file__,
    "info": ds_native.build_info(),
    "y": y.tolist(),
    "warnings": [(w.category.__name__, str(w.message)) for w in caught],
}))
"""


def _run(args: list[Any], *, cwd: Path, env: dict[str, str] | None = None) -> tuple[str, str]:
    proc = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Build from a copy: sdist builds write egg-info next to the sources.
    source = tmp_path_factory.mktemp("source") / "ds-native"
    shutil.copytree(
        DIST_ROOT,
        source,
        ignore=shutil.ignore_patterns(
            "build",
            "dist",
            "*.egg-info",
            "__pycache__",
            ".pytest_cache",
            "*.so",
            "*.pyd",
            "_build_error.txt",
        ),
    )
    out = tmp_path_factory.mktemp("sdist")
    build = "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])"
    _run([sys.executable, "-c", build, out], cwd=source)
    (path,) = out.glob("ds_native-*.tar.gz")
    return path


def _wheel_from_sdist(sdist: Path, tmp_path: Path, env: dict[str, str]) -> tuple[Path, str]:
    wheels = tmp_path / "wheels"
    stdout, stderr = _run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
         "--no-index", "--no-cache-dir", "-w", wheels, sdist],
        cwd=tmp_path,
        env=env,
    )  # fmt: skip
    (wheel,) = wheels.glob("ds_native-*.whl")
    return wheel, stdout + stderr


def _install_and_check(wheel: Path, tmp_path: Path) -> dict[str, Any]:
    target = tmp_path / "site"
    _run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", target,
         wheel],
        cwd=tmp_path,
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(target)}
    stdout, _ = _run([sys.executable, "-c", _CHECK], cwd=tmp_path, env=env)
    report = json.loads(stdout)
    assert Path(report["file"]).is_relative_to(target), report["file"]
    return report


def test_sdist_ships_c_sources_and_build_scripts(sdist: Path) -> None:
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert {
        "setup.py",
        "build_ffi.py",
        "pyproject.toml",
        "csrc/ds_native.h",
        "csrc/axpy.c",
        "csrc/cpu_features.c",
        "src/ds_native/py.typed",
    } <= names
    assert not any(name.endswith((".so", ".o", "_build_error.txt")) for name in names)


@pytest.mark.slow  # every test session installs a wheel built with the compiler already
def test_wheel_from_sdist_with_compiler(sdist: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    wheel, _ = _wheel_from_sdist(sdist, tmp_path, env)
    with zipfile.ZipFile(wheel) as zf:
        assert any(n.startswith("ds_native/_ds_native_cffi") for n in zf.namelist())

    report = _install_and_check(wheel, tmp_path)

    assert report["info"]["available"] is True
    assert report["y"] == [1.0, 5.0, 9.0, 13.0, 17.0]
    assert report["warnings"] == []


def test_wheel_without_compiler_installs_and_falls_back(sdist: Path, tmp_path: Path) -> None:
    wheel, log = _wheel_from_sdist(sdist, tmp_path, {**os.environ, "CC": NO_COMPILER})
    assert "ds-native installs without its C extension" in log
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    assert not any(n.startswith("ds_native/_ds_native_cffi") for n in names)
    assert "ds_native/_build_error.txt" in names

    report = _install_and_check(wheel, tmp_path)

    assert report["info"]["available"] is False
    assert NO_COMPILER in report["info"]["reason"]
    assert report["y"] == [1.0, 5.0, 9.0, 13.0, 17.0]
    ((category, message),) = report["warnings"]
    assert category == "NativeFallbackWarning"
    assert message.startswith("ds_native: C extension not built at install time (")
    assert NO_COMPILER in message
