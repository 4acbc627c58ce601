"""``deepspeed.runtime.utils``: the helpers of DeepSpeed's runtime that user code calls.

Gradient norms come from ds-optim, partitioning from ds-pipe (when installed), device and
memory queries from the accelerator; ``move_to_device`` and ``see_memory_usage`` are small
helpers of their own.
"""

from __future__ import annotations

import gc
import math
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

import ds_comm
from ds_engine._loader import seed_everything
from ds_optim import global_grad_norm

__all__ = [
    "clip_grad_norm_",
    "empty_cache",
    "ensure_directory_exists",
    "get_global_norm",
    "move_to_device",
    "partition_balanced",  # noqa: F822  (module __getattr__: ds-pipe is optional)
    "partition_uniform",  # noqa: F822
    "see_memory_usage",
    "set_random_seed",
]


def move_to_device(
    item: Any,
    device: torch.device | str,
    criterion_func: Callable[[torch.Tensor], bool] | None = None,
) -> Any:
    """``item`` with every tensor (for which ``criterion_func`` is true) moved to ``device``,
    through lists, tuples and dicts; other values pass through unchanged.

    Example:
        >>> batch = move_to_device({"ids": ids, "mask": [m1, m2]}, engine.device)
    """
    if torch.is_tensor(item):
        return item.to(device) if criterion_func is None or criterion_func(item) else item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        moved = [move_to_device(v, device, criterion_func) for v in item]
        return type(item)(*moved) if hasattr(item, "_fields") else tuple(moved)
    if isinstance(item, dict):
        return type(item)({k: move_to_device(v, device, criterion_func) for k, v in item.items()})
    return item


def see_memory_usage(message: str, force: bool = False) -> None:
    """Log the accelerator's allocated/reserved memory (and their peaks) and the host's, on rank
    0, then reset the peaks; does nothing unless ``force`` (as in DeepSpeed, where callers leave
    the calls in place and switch them on when debugging).
    """
    if not force or (ds_comm.is_initialized() and ds_comm.get_rank() != 0):
        return
    from ds_engine.accelerator import get_accelerator
    from ds_engine.utils import logger

    gc.collect()
    acc = get_accelerator()
    gib = 1024**3
    logger.info(message)
    logger.info(
        f"MA {acc.memory_allocated() / gib:.2f} GB  Max_MA {acc.max_memory_allocated() / gib:.2f}"
        f" GB  CA {acc.memory_reserved() / gib:.2f} GB  Max_CA"
        f" {acc.max_memory_reserved() / gib:.2f} GB"
    )
    pages, page_size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    available = os.sysconf("SC_AVPHYS_PAGES")
    used = (pages - available) * page_size / gib
    logger.info(
        f"CPU Virtual Memory:  used = {used:.2f} GB, percent = {100 * (1 - available / pages):.1f}%"
    )
    acc.reset_peak_memory_stats()


def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2,
    mpu: Any = None,
) -> torch.Tensor:
    """Scale gradients in place so that their norm is at most ``max_norm``; return the norm
    before clipping (DeepSpeed's signature).

    Without ``mpu`` the norm covers this rank's gradients (data-parallel replicas hold equal
    gradients after the reduction). With an ``mpu``, it is reduced over the model-parallel
    group; parameters replicated across that group (no ``model_parallel`` attribute set true)
    count once, on model-parallel rank 0.
    """
    params = [parameters] if torch.is_tensor(parameters) else list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    group = None
    counted = grads
    if mpu is not None:
        group = mpu.get_model_parallel_group()
        first = mpu.get_model_parallel_rank() == 0
        counted = [
            p.grad
            for p in params
            if p.grad is not None and (getattr(p, "model_parallel", False) or first)
        ]
    total = global_grad_norm(counted, norm_type, group)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    coef = torch.where(torch.isfinite(total), coef, torch.ones_like(coef))
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))
    return total


def get_global_norm(norm_list: Iterable[float]) -> float:
    """The 2-norm of per-group 2-norms: ``sqrt(sum(n ** 2))``."""
    return math.sqrt(sum(float(n) ** 2 for n in norm_list))


def set_random_seed(seed: int) -> None:
    """Seed Python's ``random``, torch (every device) and numpy (when imported)."""
    seed_everything(seed)


def empty_cache() -> None:
    """Release the accelerator's cached memory and reset its peak statistics."""
    from ds_engine.accelerator import get_accelerator

    acc = get_accelerator()
    acc.empty_cache()
    acc.reset_peak_memory_stats()


def ensure_directory_exists(filename: str | os.PathLike[str]) -> None:
    """Create the directory ``filename`` will be written in."""
    os.makedirs(os.path.dirname(os.fspath(filename)) or ".", exist_ok=True)


def __getattr__(name: str) -> Any:
    # Layer partitioning is ds-pipe's (optional for ds-engine): imported on first use.
    if name in ("partition_uniform", "partition_balanced"):
        from ds_engine.runtime.pipe import module

        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
