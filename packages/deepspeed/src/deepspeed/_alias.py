"""``deepspeed.<path>`` is ``ds_engine.<path>``: one import hook, one module object per path.

[Note: one module under two names]
DeepSpeed scripts and clients import ``deepspeed.runtime.zero.partition_parameters``,
``deepspeed.ops.op_builder`` and dozens of other paths; ds provides each of them in the
``ds_engine`` namespace. Copying a file per path would give two module objects per path: a
client that monkeypatches ``deepspeed.X.f`` would not change ``ds_engine.X.f``, and classes
would be defined twice, so ``isinstance`` would disagree. Instead :class:`AliasFinder` sits first
on ``sys.meta_path`` and answers every ``deepspeed.<rest>`` by importing ``ds_engine.<rest>`` and
registering that same object under the ``deepspeed`` name. The module keeps its own ``__name__``
and ``__spec__`` (``ds_engine.<rest>``), so pickling, ``inspect`` and ``importlib.reload`` see
the real module.

``importlib``'s ``module_from_spec`` always overwrites ``__spec__`` with the spec the finder
returned; :meth:`AliasLoader.exec_module` puts the real one back.

A path ``ds_engine`` lacks fails with a ``ModuleNotFoundError`` that names both
``deepspeed.<rest>`` and ``ds_engine.<rest>``, so the user sees where ds looked. A path that
exists but fails to import (a missing optional package, say) raises its own error unchanged.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["TARGET", "AliasFinder", "AliasLoader", "install"]

ALIAS = "deepspeed"
TARGET = "ds_engine"
# Modules of this distribution itself, found on the package's own path (not aliased).
_OWN = frozenset({"_alias", "git_version_info"})


class AliasLoader(importlib.abc.Loader):
    """Hands the already imported ``ds_engine`` module to the import system."""

    def __init__(self, module: ModuleType) -> None:
        self._module = module
        spec = module.__spec__
        assert spec is not None  # an imported module always has one
        self._spec: importlib.machinery.ModuleSpec = spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return self._module

    def exec_module(self, module: ModuleType) -> None:
        # Already executed under its real name; undo module_from_spec's __spec__ overwrite.
        module.__spec__ = self._spec

    def get_code(self, fullname: str) -> object:
        """The real module's code, for ``python -m deepspeed.<path>`` (runpy runs it as
        ``__main__``, so ``python -m deepspeed.launcher.runner`` starts ds-launch)."""
        loader: Any = self._spec.loader  # a module imported from source has a SourceLoader
        return loader.get_code(self._spec.name)

    def is_package(self, fullname: str) -> bool:
        return self._spec.submodule_search_locations is not None


class AliasFinder(importlib.abc.MetaPathFinder):
    """Finds ``deepspeed.<rest>`` as ``ds_engine.<rest>`` (see [Note: one module under two
    names])."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        head, _, rest = fullname.partition(".")
        if head != ALIAS or not rest or rest.partition(".")[0] in _OWN:
            return None
        real_name = f"{TARGET}.{rest}"
        try:
            module = importlib.import_module(real_name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not _is_prefix(exc.name, real_name):
                raise  # ds_engine.<rest> exists; something it imports is missing
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: ds provides DeepSpeed's modules from the "
                f"{TARGET} namespace, and {exc.name!r} does not exist there (this path of "
                "DeepSpeed is not implemented by ds)",
                name=fullname,
            ) from exc
        return importlib.machinery.ModuleSpec(
            fullname,
            AliasLoader(module),
            origin=getattr(module.__spec__, "origin", None),
            is_package=hasattr(module, "__path__"),
        )


def _is_prefix(missing: str, real_name: str) -> bool:
    """True when ``missing`` is ``real_name`` or one of its parent packages."""
    return real_name == missing or real_name.startswith(missing + ".")


def install() -> AliasFinder:
    """Put the finder first on ``sys.meta_path`` (once) and return it."""
    for finder in sys.meta_path:
        if isinstance(finder, AliasFinder):
            return finder
    finder = AliasFinder()
    sys.meta_path.insert(0, finder)
    return finder
