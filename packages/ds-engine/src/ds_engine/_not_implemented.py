"""Names of DeepSpeed's surface that ds does not implement: importable, refused when used.

A client module often imports a name at its top and uses it only on one path; failing the import
would break the paths ds does support. So such a name is a class that raises
``NotImplementedError`` naming the feature as soon as it is called or instantiated.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

__all__ = ["not_implemented"]


def not_implemented(path: str, feature: str) -> type:
    """A class standing for DeepSpeed's ``path`` whose call raises ``NotImplementedError``.

    Example:
        >>> FlopsProfiler = not_implemented("deepspeed.profiling.flops_profiler.FlopsProfiler",
        ...                                 "the FLOPS profiler")
        >>> FlopsProfiler(model)  # NotImplementedError: ... is not implemented in ds
    """
    name = path.rpartition(".")[2]
    module = sys._getframe(1).f_globals.get("__name__", __name__)  # where the name is defined

    def refuse(cls: type, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"{path} ({feature}) is not implemented in ds")

    return type(
        name,
        (),
        {"__new__": refuse, "__doc__": f"Not implemented in ds: {feature}.", "__module__": module},
    )
