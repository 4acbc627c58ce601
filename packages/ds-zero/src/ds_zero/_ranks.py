"""Which ranks take part in a checkpoint check, and their shared verdict.

A check over a process group splits the files among its ranks and gathers every rank's
problems, so all ranks raise the same error and none waits for a rank that gave up
(:func:`agree`). ``group=THIS_PROCESS`` checks alone even where a process group exists:
consolidation (``zero_to_fp32`` and friends) is called from one rank or from a plain script, and
waiting there for ranks that never call it would hang (DeepSpeed's zero_to_fp32 is not
collective either).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

__all__ = ["THIS_PROCESS", "agree", "ranks_in"]

THIS_PROCESS = "this process"


def ranks_in(group: Any) -> tuple[int, int]:
    """``(this rank, ranks)`` of ``group`` (None: the default group; ``THIS_PROCESS``: alone)."""
    if group == THIS_PROCESS:
        return 0, 1
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def agree(problems: Sequence[str], group: Any = None) -> list[str]:
    """Every rank's problems, on every rank (a collective: all ranks must call it)."""
    _, world = ranks_in(group)
    if world == 1:
        return list(problems)
    out: list[Any] = [None] * world
    dist.all_gather_object(out, list(problems), group=group)
    return [p for share in out for p in share]
