"""``ds-report``: what this environment can run, as a table of [OKAY]/[NO] with a hint per NO.

Every check is independent and never raises: a report is most useful on a broken machine.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Check", "collect", "format_report", "main"]

_DISTRIBUTIONS = (
    "ds-comm",
    "ds-optim",
    "ds-zero",
    "ds-pipe",
    "ds-moe",
    "ds-offload-aio",
    "ds-launch",
    "ds-engine",
    "ds-kernels",
    "ds-native",
)


@dataclass(frozen=True)
class Check:
    """One line of the report: ``ok`` with its detail, or a hint on how to get it."""

    name: str
    ok: bool
    detail: str
    hint: str = ""


def _guarded(name: str, hint: str, probe: Callable[[], tuple[bool, str]]) -> Check:
    try:
        ok, detail = probe()
    except Exception as exc:  # a report must survive any broken component
        ok, detail = False, f"{type(exc).__name__}: {exc}"
    return Check(name, ok, detail, "" if ok else hint)


def _module(name: str) -> Any:
    return importlib.import_module(name)


def _torch_checks() -> list[Check]:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    checks = [
        Check("torch", True, torch.__version__),
        Check(
            "CUDA",
            cuda,
            f"{torch.version.cuda}, {torch.cuda.device_count()} GPU(s)" if cuda else "no GPU",
            "" if cuda else "CPU training only (gloo); install a CUDA build of torch for GPUs",
        ),
    ]
    nccl = cuda and dist.is_nccl_available()
    version = ".".join(map(str, _nccl_version())) if nccl else "unavailable"
    checks.append(Check("NCCL", nccl, version, "" if nccl else "needs CUDA; gloo is used on CPU"))
    for backend, available in (
        ("gloo", dist.is_gloo_available()),
        ("nccl", dist.is_nccl_available()),
        ("mpi", dist.is_mpi_available()),
    ):
        hint = "" if available else f"torch was built without the {backend} backend"
        if backend == "mpi" and not available:
            hint = "optional: ds-comm runs over gloo/nccl and discovers ranks with mpi4py"
        detail = "available" if available else "not built"
        checks.append(Check(f"torch.distributed {backend}", available, detail, hint))
    return checks


def _distribution_checks() -> list[Check]:
    checks = []
    for name in _DISTRIBUTIONS:
        try:
            checks.append(Check(name, True, importlib.metadata.version(name)))
        except importlib.metadata.PackageNotFoundError:
            checks.append(Check(name, False, "not installed", f"pip install {name}"))
    return checks


def _native() -> tuple[bool, str]:
    info = _module("ds_native").build_info()
    if not info["available"]:
        return False, str(info["reason"])
    return True, f"compiled {info['compiled_simd']}, CPU SIMD {info['simd_level']}"


def _aio() -> tuple[bool, str]:
    info = _module("ds_offload_aio").backend_info()
    return info["backend"] == "libaio", info["reason"] or "libaio"


def _triton() -> tuple[bool, str]:
    return True, _module("triton").__version__


def _mpi() -> tuple[bool, str]:
    mpi = _module("mpi4py.MPI")
    library = mpi.Get_library_version().strip().splitlines()[0]
    return True, f"mpi4py {_module('mpi4py').__version__}, {library}"


def collect() -> list[Check]:
    """Every check of the report."""
    checks = [Check("python", True, f"{platform.python_version()} ({sys.executable})")]
    checks += _guarded_list(_torch_checks, "torch", "pip install torch")
    checks += _distribution_checks()
    checks.append(
        _guarded(
            "native kernels (ds-native)",
            "reinstall ds-native with a C compiler (apt-get install build-essential)",
            _native,
        )
    )
    checks.append(
        _guarded(
            "libaio (ds-offload-aio)",
            "apt-get install libaio-dev, then reinstall ds-offload-aio (a thread pool is used)",
            _aio,
        )
    )
    checks.append(_guarded("triton", "pip install triton (GPU kernels of ds-kernels)", _triton))
    checks.append(
        _guarded("mpi4py / MPI library", "pip install mpi4py mpich (MPI launchers only)", _mpi)
    )
    return checks


def _guarded_list(probe: Callable[[], list[Check]], name: str, hint: str) -> list[Check]:
    try:
        return probe()
    except Exception as exc:
        return [Check(name, False, f"{type(exc).__name__}: {exc}", hint)]


def format_report(checks: list[Check]) -> str:
    """The checks as an aligned table; each [NO] line ends with its hint."""
    width = max(len(c.name) for c in checks)
    lines = ["ds environment report", "-" * (width + 50)]
    for c in checks:
        status = "[OKAY]" if c.ok else "[NO]  "
        line = f"{c.name:<{width}}  {status}  {c.detail}"
        if c.hint:
            line += f"  -> {c.hint}"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the report (the ``ds-report`` console script); exit status 0."""
    del argv
    print(format_report(collect()))
    return 0


def _nccl_version() -> tuple[Any, ...]:
    from torch.cuda import nccl

    version: Any = nccl.version()  # (major, minor, patch[, suffix]), or one int on old torch
    return tuple(version) if isinstance(version, tuple) else (version,)
