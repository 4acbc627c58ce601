"""Loads the libaio engine once and says which backend is active, and why.

See [Note: libaio is optional] in setup.py for how a missing extension comes about.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings
from dataclasses import dataclass
from importlib import resources
from typing import Any

from ds_offload_aio.api import AioFallbackWarning, BackendInfo

_MODULE = "ds_offload_aio._aio_cffi"


@dataclass(frozen=True)
class Engine:
    """The cffi ``ffi``/``lib`` pair, or the reason there is none."""

    ffi: Any = None
    lib: Any = None
    unavailable_reason: str | None = None


def _load() -> Engine:
    try:
        module = importlib.import_module(_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != _MODULE:
            return Engine(unavailable_reason=f"libaio engine failed to import ({exc})")
        reason_file = resources.files("ds_offload_aio") / "_build_error.txt"
        if reason_file.is_file():
            detail = reason_file.read_text().strip()
            return Engine(unavailable_reason=f"libaio engine not built at install time ({detail})")
        return Engine(unavailable_reason="libaio engine not built at install time")
    except ImportError as exc:  # e.g. libaio.so.1 missing at run time
        return Engine(unavailable_reason=f"libaio engine failed to import ({exc})")
    return _probe(Engine(ffi=module.ffi, lib=module.lib))


def _probe(engine: Engine) -> Engine:
    """A kernel without AIO (or a sandbox that forbids io_setup) makes the engine useless."""
    error = engine.ffi.new("int *")
    ctx = engine.lib.ds_aio_ctx_new(1, error)
    if ctx == engine.ffi.NULL:
        return Engine(unavailable_reason=f"io_setup failed: {os.strerror(error[0])}")
    engine.lib.ds_aio_ctx_free(ctx)
    return engine


# A process-wide fact, like the import of any other module; tests swap it with monkeypatch.
ENGINE: Engine = _load()


def backend_info() -> BackendInfo:
    """Which backend ``AioHandle(backend="auto")`` uses, and why libaio is missing if it is.

    Example:
        >>> ds_offload_aio.backend_info()
        {'backend': 'libaio', 'reason': None}
    """
    if ENGINE.lib is None:
        return BackendInfo(backend="threads", reason=ENGINE.unavailable_reason)
    return BackendInfo(backend="libaio", reason=None)


@functools.cache
def warn_once(message: str) -> None:
    """Warns once per process and message (the fallbacks are facts of the machine)."""
    warnings.warn(message, AioFallbackWarning, stacklevel=3)
