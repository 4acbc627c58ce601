"""Which vector path a C kernel runs: the one rule every kernel's ``simd=`` argument follows."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["requested_simd_code"]


def requested_simd_code(
    kernel: str,
    simd: str | None,
    env: str,
    codes: Mapping[Any, int],
    choices: Sequence[str],
    supported: Callable[[int], bool] | None,
    auto: Callable[[], int] | None,
) -> int:
    """The C code for the requested path (0: let the kernel pick); raises if it cannot run.

    Args:
        kernel: the function's name, for the error message.
        simd: the caller's ``simd=`` (None: ``$env``, then automatic).
        env: the environment variable that forces a path.
        codes: path name -> the C kernel's code.
        choices: the path names in the order the error lists them (the ``Literal``'s).
        supported, auto: the kernel's "can this CPU run code" and "best code" functions (None
            when the extension is not built: nothing to check).
    """
    source = "simd"
    if simd is None:
        simd = os.environ.get(env) or None
        source = f"${env}"
        if simd is None:
            return 0
    if simd not in codes:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{kernel}: {source} must be one of {listed} or unset, got {simd!r}")
    code = codes[simd]
    if supported is not None and auto is not None and not supported(code):
        names = {c: n for n, c in codes.items()}
        raise ValueError(
            f"{kernel}: {source}={simd!r} cannot run on this CPU (it supports up to "
            f"{names[auto()]!r}); pass a narrower path or leave {source} unset"
        )
    return code
