"""Find a test body inside a worker: load its module by file path, once per path.

pytest collects with ``--import-mode=importlib``, so test modules are not importable by name
(and names like ``test_install`` repeat across packages). The worker loads the file with
``spec_from_file_location`` and registers it under the parent's module name when that name is
free, so objects from the test module pickled by the parent unpickle in the worker.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from collections.abc import Callable
from typing import Any

_by_path: dict[str, types.ModuleType] = {}


def _same_file(a: str | None, b: str) -> bool:
    if not a:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _add_missing_parents(name: str) -> None:
    """Insert placeholder parent packages so ``pickle`` can ``__import__`` a dotted test module."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if parent not in sys.modules:
            placeholder = types.ModuleType(parent)
            placeholder.__path__ = []
            sys.modules[parent] = placeholder


def _try_import(name: str) -> types.ModuleType | None:
    """Import ``name`` normally (keeps package-relative imports of library bodies working)."""
    try:
        return importlib.import_module(name)
    except Exception:
        return None


def load_module(name: str, path: str) -> types.ModuleType:
    """Return the module at ``path`` (loaded once per path), preferring ``sys.modules[name]``."""
    cached = _by_path.get(path)
    if cached is not None:
        return cached
    existing = sys.modules.get(name) or _try_import(name)
    if existing is not None and _same_file(getattr(existing, "__file__", None), path):
        _by_path[path] = existing
        return existing
    register = existing is None
    mod_name = name if register else f"_ds_testing_body_{len(_by_path)}_{name}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load a module from {path!r}")
    module = importlib.util.module_from_spec(spec)
    if register:
        _add_missing_parents(mod_name)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[mod_name]
        raise
    _by_path[path] = module
    return module


def resolve(name: str, path: str, qualname: str) -> Callable[..., Any]:
    """Return the function ``qualname`` of the module at ``path``."""
    obj: Any = load_module(name, path)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj
