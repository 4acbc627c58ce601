"""``deepspeed``: the opt-in alias of ds under DeepSpeed's import name.

Installing this distribution (``pip install packages/deepspeed``) lets unmodified DeepSpeed
scripts and clients (transformers, accelerate, Lightning) run on ds. It is a thin layer:

- ``import deepspeed.X.Y`` gives exactly the module ``ds_engine.X.Y`` (one object under both
  names; see [Note: one module under two names] in ``deepspeed._alias``);
- ``deepspeed.<name>`` is ``ds_engine.<name>`` (``initialize``, ``init_distributed``,
  ``DeepSpeedEngine``, ``zero``, ``comm``, ``add_config_arguments``, ...), loaded on first use;
- ``__version__`` is ``"0.19.8"``, the DeepSpeed release whose surface ds reproduces.

Never install it next to Microsoft's DeepSpeed: both own the ``deepspeed`` import name.

Example:
    >>> import deepspeed
    >>> engine, optimizer, _, _ = deepspeed.initialize(model=model, config="ds_config.json")
"""

from __future__ import annotations

from typing import Any

import ds_engine
from deepspeed import _alias
from deepspeed.git_version_info import git_branch, git_hash, version

# From here on, ``import deepspeed.<path>`` is ``ds_engine.<path>``.
_alias.install()

__version__ = version
__version_major__, __version_minor__, __version_patch__ = (int(v) for v in version.split("."))
__git_hash__ = git_hash
__git_branch__ = git_branch

_OWN = [
    "__version__",
    "__version_major__",
    "__version_minor__",
    "__version_patch__",
    "__git_hash__",
    "__git_branch__",
    "version",
    "git_hash",
    "git_branch",
]
__all__ = [*_OWN, *(name for name in ds_engine.__all__ if name != "__version__")]


def __getattr__(name: str) -> Any:
    # Everything else is ds_engine's (its lazily imported submodules included).
    try:
        return getattr(ds_engine, name)
    except AttributeError:
        raise AttributeError(
            f"module 'deepspeed' has no attribute {name!r} (ds provides DeepSpeed's names from "
            f"ds_engine, which has no {name!r})"
        ) from None


def __dir__() -> list[str]:
    return sorted({*globals(), *dir(ds_engine)})
