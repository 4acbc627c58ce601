"""Triton as an optional import: without it every kernel runs its torch reference.

Kernel modules take ``triton``, ``tl`` and ``jit`` from here rather than importing Triton
themselves, so that a missing Triton is handled in one place.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

__all__ = ["is_interpreted", "jit", "tl", "triton", "triton_available", "unavailable_reason"]

_IMPORT_ERROR: str | None = None

if TYPE_CHECKING:
    import triton
    import triton.language as tl
else:
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:
        triton = tl = None
        _IMPORT_ERROR = str(exc)


def triton_available() -> bool:
    """Whether Triton imported, so that the dispatchers may choose the Triton kernels.

    Example:
        >>> ds_kernels.triton_available()
        True
    """
    return triton is not None


def unavailable_reason() -> str | None:
    """Why Triton is unavailable, or None when it imported."""
    if triton is not None:
        return None
    return f"Triton failed to import ({_IMPORT_ERROR}); install ds-kernels[triton]"


def jit(fn: Callable[..., Any]) -> Any:
    """``triton.jit`` when Triton imported; otherwise the plain function, which is never launched.

    Triton reads ``TRITON_INTERPRET`` here, at decoration time, that is when ``ds_kernels`` is
    first imported.
    """
    if triton is None:
        return fn
    return triton.jit(fn)


def is_interpreted(kernel: object) -> bool:
    """Whether ``kernel`` runs in Triton's interpreter (``TRITON_INTERPRET=1``), on CPU tensors."""
    # Not imported means nothing is interpreted; importing it would need numpy.
    interpreter = sys.modules.get("triton.runtime.interpreter")
    return interpreter is not None and isinstance(kernel, interpreter.InterpretedFunction)
