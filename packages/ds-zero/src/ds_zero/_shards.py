"""The unit of a reshardable checkpoint: one rank's contiguous piece of one parameter.

[Note: tensor shards]
Every ZeRO stage describes what a rank holds the same way: for each parameter (by its name in
``model.named_parameters()``), the half-open range ``[start, stop)`` of elements of the
flattened, unpadded parameter, and the values the rank holds for that range: ``"param"`` (the
fp32 master weights) and one entry per elementwise optimizer state (``"exp_avg"``,
``"exp_avg_sq"``, ...). Padding never appears in a shard. Stage 0 (replicated) names the range
each rank is responsible for, so that across all ranks every element of every parameter is
covered exactly once. Checkpoints are written from these records and read back through a
lookup of any range, which is why world size and stage may change between save and load.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

__all__ = ["ShardLookup", "TensorShard", "read_then_settle"]

_Read = TypeVar("_Read")


@dataclass(frozen=True)
class TensorShard:
    """One rank's piece of one parameter (see [Note: tensor shards]).

    Attributes:
        name: the parameter's name in ``model.named_parameters()``.
        shape: the parameter's full (global) shape.
        dtype: the model parameter's dtype (the master values are fp32 regardless).
        start: first element of the flattened parameter held here.
        stop: one past the last element held here (``start == stop``: nothing).
        values: ``"param"`` and each elementwise optimizer state, 1-D tensors of
            ``stop - start`` elements on any device.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    stop: int
    values: Mapping[str, torch.Tensor]

    @property
    def numel(self) -> int:
        return self.stop - self.start


# lookup(name, start, stop) -> {"param": fp32 values, "exp_avg": ..., ...} for that range, read
# from a checkpoint; keys missing from the checkpoint are absent from the mapping.
ShardLookup = Callable[[str, int, int], Mapping[str, torch.Tensor]]


def read_then_settle(lookup: ShardLookup, read: Callable[[], _Read]) -> _Read:
    """``read()`` (which looks values up into tensors of the caller's own, writing nothing the
    model or optimizer uses), then the lookup's verdict when it has one (a ds-zero
    ``SettlingLookup``, whose checkpoint is still being verified; a collective), so the
    checksums run beside the reading (ds-zero's [Note: verification overlapped with reading]).
    A failure to read is told to every rank through the verdict, then raised."""
    settle = getattr(lookup, "settle", None)
    try:
        found = read()
    except Exception as exc:
        if settle is None:
            raise
        settle(exc)  # every rank hears of it; raises
        raise
    if settle is not None:
        settle()
    return found
