"""``deepspeed.utils.module_utils``: get and set nested attributes by dotted name."""

from __future__ import annotations

from typing import Any

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model: Any, module_name: str) -> Any:
    """``model.a.b.c`` for ``"a.b.c"``."""
    out = model
    for name in module_name.split("."):
        out = getattr(out, name)
    return out


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """Set ``model.a.b.c = module`` for ``"a.b.c"``."""
    *path, last = module_name.split(".")
    setattr(recursive_getattr(model, ".".join(path)) if path else model, last, module)
