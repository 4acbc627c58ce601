"""Loads the C extension once and reports what was built.

See [Note: optional native build] in setup.py for how a missing extension comes about.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from dataclasses import dataclass
from importlib import resources
from typing import Any, cast

from ds_native.api import BuildInfo, NativeFallbackWarning, SimdLevel

_MODULE = "ds_native._ds_native_cffi"
_BUILD_ERROR_FILE = "_build_error.txt"  # written by setup.py's OptionalBuildExt


@dataclass(frozen=True)
class NativeExtension:
    """The cffi module's ``ffi`` and ``lib`` objects, or why there are none."""

    ffi: Any = None
    lib: Any = None
    unavailable_reason: str | None = None


def load_extension() -> NativeExtension:
    """Imports the compiled module; never raises for a missing or broken build."""
    try:
        # import_module, not `from ds_native import ...`: inside the package's own initialisation
        # the latter reports a missing module as a generic ImportError.
        module = importlib.import_module(_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name == _MODULE:
            return NativeExtension(unavailable_reason=_not_built_reason())
        return NativeExtension(unavailable_reason=f"C extension failed to import ({exc})")
    except ImportError as exc:  # e.g. built for another ABI, or an unresolved symbol
        return NativeExtension(unavailable_reason=f"C extension failed to import ({exc})")
    return NativeExtension(ffi=module.ffi, lib=module.lib)


def _not_built_reason() -> str:
    error_file = resources.files("ds_native") / _BUILD_ERROR_FILE
    if error_file.is_file():
        return f"C extension not built at install time ({error_file.read_text().strip()})"
    return "C extension not built (no C compiler at install time?)"


# A process-wide fact, like the import of any other module; tests swap it with monkeypatch.
EXTENSION: NativeExtension = load_extension()


@functools.cache
def warn_fallback(reason: str) -> None:
    """Warns, once per process and reason, that the torch references replace the C kernels.

    Called directly from a ``choose_backend`` that a public dispatcher called directly, so that
    ``stacklevel`` points at the user's call.
    """
    warnings.warn(
        f"ds_native: {reason}; using torch reference kernels. "
        "Reinstall ds-native with a working C compiler to get the native kernels.",
        NativeFallbackWarning,
        stacklevel=4,
    )


def native_available() -> bool:
    """Whether the C extension is loaded (otherwise every kernel runs its torch reference).

    Example:
        >>> ds_native.native_available()
        True
    """
    return EXTENSION.lib is not None


def _c_string(pointer: Any) -> str:
    return cast(bytes, EXTENSION.ffi.string(pointer)).decode()


def simd_level() -> SimdLevel | None:
    """The widest SIMD level the running CPU supports, or None without the C extension.

    Asked of the CPU at run time (``__builtin_cpu_supports``), not fixed at build time.
    """
    if EXTENSION.lib is None:
        return None
    return cast(SimdLevel, _c_string(EXTENSION.lib.ds_native_simd_level()))


def build_info() -> BuildInfo:
    """What was built and what the CPU supports, for bug reports and ``ds_report``-style tools.

    Example:
        >>> ds_native.build_info()["simd_level"]
        'avx2'
    """
    from ds_native import _adam  # imports this module

    lib = EXTENSION.lib
    if lib is None:
        return BuildInfo(
            available=False,
            reason=EXTENSION.unavailable_reason,
            simd_level=None,
            compiled_simd=None,
            compiler=None,
            compile_args=None,
            adam_simd=None,
        )
    return BuildInfo(
        available=True,
        reason=None,
        simd_level=simd_level(),
        compiled_simd=_c_string(lib.ds_native_compiled_simd()),
        compiler=_c_string(lib.ds_native_compiler()),
        compile_args=_c_string(lib.ds_native_compile_args()).split(),
        adam_simd=_adam.default_simd(),
    )
