"""After the step: every rank's updated partition gathered back into every rank's parameters.

[Note: gathering updated parameters]
A group's partition is consecutive unit shards, so any range of it is one contiguous input.
Ranges of at most ``allgather_bucket_size / world_size`` elements per rank are gathered one
after the other. A range that is exactly one unit's shard is gathered straight into the unit's
slice of the flat parameter buffer, which is laid out rank-major as ``all_gather_into_tensor``
writes (no copy); other ranges land in a staging buffer and are copied out column by column.
With ``allgather_partitions`` off, each rank's block is broadcast from its owner instead
(DeepSpeed's alternative for backends without a fast all-gather).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

import ds_comm
from ds_zero._layout import ALIGN, FlatGroup, FlatUnit

__all__ = ["gather_partition"]

_Segment = tuple[FlatUnit, int, int]  # a unit and a range [start, end) of its shard


def _pieces(group: FlatGroup, limit: int) -> Iterator[list[_Segment]]:
    """Consecutive segments of the partition, at most ``limit`` elements per piece."""
    piece: list[_Segment] = []
    used = 0
    for unit in group.units:
        start = 0
        while start < unit.shard_numel:
            take = min(unit.shard_numel - start, limit - used)
            piece.append((unit, start, start + take))
            used += take
            start += take
            if used == limit:
                yield piece
                piece, used = [], 0
    if piece:
        yield piece


def gather_partition(
    group: FlatGroup,
    partition: torch.Tensor,
    *,
    pg: Any,
    rank: int,
    world_size: int,
    bucket_numel: int,
    use_all_gather: bool = True,
) -> None:
    """Write every rank's ``partition`` (this rank passes its own) into ``group.flat``.

    Args:
        group: the layout whose flat buffer (the parameters) is written.
        partition: this rank's updated partition, in the parameters' dtype and device.
        pg: data-parallel process group.
        rank: this rank's index in ``pg``.
        world_size: ranks in ``pg``.
        bucket_numel: ``allgather_bucket_size``: most elements gathered per collective.
        use_all_gather: False to broadcast each rank's block instead.
    """
    per_rank = max(ALIGN, bucket_numel // world_size)
    for piece in _pieces(group, per_rank):
        first, start, _ = piece[0]
        numel = sum(end - begin for _, begin, end in piece)
        source = partition.narrow(0, first.shard_start + start, numel)
        whole_unit = len(piece) == 1 and numel == first.shard_numel
        if whole_unit:
            out = first.full(group.flat).view(world_size, numel)
        else:
            out = torch.empty(world_size, numel, dtype=partition.dtype, device=partition.device)
        _gather_rows(
            out, source, pg=pg, rank=rank, world_size=world_size, use_all_gather=use_all_gather
        )
        if whole_unit:
            continue
        column = 0
        for unit, begin, end in piece:
            width = end - begin
            target = unit.full(group.flat).view(world_size, unit.shard_numel)
            target[:, begin:end].copy_(out[:, column : column + width])
            column += width


def _gather_rows(
    out: torch.Tensor,
    source: torch.Tensor,
    *,
    pg: Any,
    rank: int,
    world_size: int,
    use_all_gather: bool,
) -> None:
    """Row ``r`` of ``out`` gets rank ``r``'s ``source``."""
    if world_size == 1:
        out[0].copy_(source)
    elif use_all_gather:
        ds_comm.all_gather_into_tensor(out.view(-1), source, group=pg)
    else:
        out[rank].copy_(source)
        for r in range(world_size):
            src = r if pg is None else dist.get_global_rank(pg, r)
            ds_comm.broadcast(out[r], src, group=pg)
