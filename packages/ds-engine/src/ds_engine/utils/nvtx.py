"""``deepspeed.utils.nvtx``: ``instrument_w_nvtx`` marks a function's calls as profiler ranges."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ds_comm.accelerator import get_accelerator

__all__ = ["enable_nvtx", "instrument_w_nvtx"]

enable_nvtx = True
F = TypeVar("F", bound=Callable[..., Any])


def instrument_w_nvtx(func: F) -> F:
    """Wrap ``func`` so that each call is one accelerator profiler range named after it (NVTX
    on CUDA, a torch profiler record on the CPU accelerator); skipped while ``torch.compile``
    traces.

    Example:
        >>> @instrument_w_nvtx
        ... def allgather_params(...): ...
    """

    @functools.wraps(func)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        mark = enable_nvtx and not torch.compiler.is_compiling()
        if mark:
            get_accelerator().range_push(func.__qualname__)
        try:
            return func(*args, **kwargs)
        finally:
            if mark:
                get_accelerator().range_pop()

    return wrapped  # type: ignore[return-value]
