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

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

__all__ = ["ShardLookup", "TensorShard", "read_then_settle", "staged_pieces", "write_range"]

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


# Where each piece of a load goes: per shard file, per tensor key, a range of a new buffer.
Destinations = dict[str, dict[str, torch.Tensor]]


def staged_pieces(
    ranges: Iterable[tuple[str, int, int, int, int]],
    masters: Sequence[torch.Tensor],
    manifest: Mapping[str, Any],
) -> tuple[Destinations, list[dict[str, torch.Tensor]]] | None:
    """New buffers of each master's size, one per saved value, and each piece's place in them,
    for the ranges a rank holds (``(checkpoint name, start, stop, master index, position in
    the master)``) of a checkpoint with zero manifest ``manifest`` (see ds-zero's [Note:
    copying the pieces into the optimizer's buffers]); None unless every range is exactly one
    piece and the masters are on the CPU."""
    if any(m.device.type != "cpu" for m in masters):
        return None
    into: Destinations = {}
    staged: list[dict[str, torch.Tensor]] = [{} for _ in masters]
    for name, start, stop, index, at in ranges:
        if start == stop:
            continue  # nothing of it here
        entry = manifest.get("tensors", {}).get(name) or {}
        pieces = [p for p in entry.get("pieces", ()) if p[2] == start and p[3] == stop]
        if len(pieces) != 1:
            return None
        file, key, _, _ = pieces[0]
        buffers = staged[index]
        for value in entry["values"]:
            if value not in buffers:
                buffers[value] = torch.zeros_like(masters[index])
            into.setdefault(file, {})[f"{key}/{value}"] = buffers[value].narrow(0, at, stop - start)
    return into, staged


def write_range(buffer: torch.Tensor, at: int, values: torch.Tensor) -> None:
    """``values`` into ``buffer`` from element ``at``, unless they are that memory already (a
    piece the checksum threads copied there as they hashed it, see :func:`staged_pieces`)."""
    place = buffer.narrow(0, at, values.numel())
    if place.data_ptr() != values.data_ptr():
        place.copy_(values)
