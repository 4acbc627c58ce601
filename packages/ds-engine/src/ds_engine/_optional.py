"""Imports of packages that are optional for ds-engine, failing with the pip command to run."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, distribution: str, what: str) -> ModuleType:
    """Import ``module``; if it is missing, raise an ImportError naming ``pip install
    <distribution>``."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        raise ImportError(
            f"{what} is provided by the {distribution} package, which is not installed: "
            f"pip install {distribution}"
        ) from exc
