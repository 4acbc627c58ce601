"""Flat layout: each param group's parameters packed into one flat buffer, cut into units that are
reduced together and sharded evenly across the data-parallel ranks.

[Note: flat layout]
A parameter group's trainable parameters are laid out back to back in one flat buffer of the
model's dtype, in reverse registration order (the order backward produces their gradients), and
the parameters become views into it (``p.data``), as DeepSpeed's flat bit16 groups. The buffer is
cut into *units* of at most ``reduce_bucket_size`` elements (a larger parameter is a unit of its
own); each unit is padded with zeros to a multiple of ``2 * num_shards`` and rank ``r`` owns the
``r``-th of its ``num_shards`` equal slices. A rank's *partition* is the concatenation of its
slices of every unit, one flat contiguous tensor per group (the fp32 master weights, the gradient
shard, the optimizer state).

DeepSpeed instead cuts the whole group into ``num_shards`` contiguous ranges. Cutting per unit is
what lets one unit's gradients be reduce-scattered as soon as the unit is complete in backward,
with equal blocks per rank (every backend's reduce-scatter needs them), and gathered back after
the step straight into the parameters' storage. The price is at most ``2 * num_shards - 1``
padding elements per unit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ALIGN", "FlatGroup", "FlatUnit", "build_layout", "padded_numel"]

# Elements per shard are a multiple of this (4-byte alignment of 16-bit shards, as DeepSpeed).
ALIGN = 2


def padded_numel(numel: int, num_shards: int) -> int:
    """``numel`` rounded up to a multiple of ``ALIGN * num_shards``."""
    step = ALIGN * num_shards
    return -(-numel // step) * step


@dataclass(eq=False)
class FlatUnit:
    """Parameters reduced together: a padded slice of the group's flat buffer.

    Attributes:
        group: index of the parameter group.
        params: member parameters, in layout order.
        offsets: element offset of each member inside the unit.
        numel: elements used by members (the rest is padding).
        padded_numel: ``numel`` rounded up to a multiple of ``ALIGN * num_shards``.
        start: offset of the unit in the group's flat buffer.
        shard_start: offset of this unit's shard in the group's partition.
        num_shards: data-parallel ranks the unit is split across (1 for stage 0).
        order: position in the launch order of all units (identical on every rank).
    """

    group: int
    params: list[torch.nn.Parameter]
    offsets: list[int]
    numel: int
    padded_numel: int
    start: int
    shard_start: int
    num_shards: int
    order: int = 0

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's slice."""
        return self.padded_numel // self.num_shards

    def full(self, flat: torch.Tensor) -> torch.Tensor:
        """This unit's padded slice of a group-sized flat tensor."""
        return flat.narrow(0, self.start, self.padded_numel)

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s slice of this unit in a group-sized flat tensor."""
        return flat.narrow(0, self.start + rank * self.shard_numel, self.shard_numel)

    def in_partition(self, partition: torch.Tensor) -> torch.Tensor:
        """This unit's slice of a partition-sized tensor."""
        return partition.narrow(0, self.shard_start, self.shard_numel)

    def param_view(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Member ``index``'s elements in a group-sized flat tensor, shaped like the parameter."""
        p = self.params[index]
        return flat.narrow(0, self.start + self.offsets[index], p.numel()).view(p.shape)


@dataclass(eq=False)
class FlatGroup:
    """One parameter group's flat buffer and units.

    Attributes:
        index: position in the optimizer's ``param_groups``.
        units: the group's units in layout order.
        flat: the parameters' storage (model dtype), ``numel`` elements.
        names: each member parameter's name, in layout order (for checkpoints).
    """

    index: int
    units: list[FlatUnit]
    flat: torch.Tensor
    names: list[str] = field(default_factory=list)

    @property
    def numel(self) -> int:
        """Elements of the flat buffer, padding included."""
        return self.flat.numel()

    @property
    def partition_numel(self) -> int:
        """Elements of one rank's partition."""
        return sum(u.shard_numel for u in self.units)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """Member parameters in layout order."""
        return [p for u in self.units for p in u.params]

    def describe(self) -> dict[str, Any]:
        """Plain-data description of the layout (checkpoint metadata), by parameter name."""
        names = iter(self.names)
        return {
            "numel": self.numel,
            "partition_numel": self.partition_numel,
            "units": [
                {
                    "padded_numel": u.padded_numel,
                    "shard_start": u.shard_start,
                    "params": [
                        [next(names), list(p.shape), off] for p, off in zip(u.params, u.offsets)
                    ],
                }
                for u in self.units
            ],
        }


def _cut_units(
    params: Sequence[torch.nn.Parameter], bucket_numel: int
) -> list[list[torch.nn.Parameter]]:
    units: list[list[torch.nn.Parameter]] = []
    used = 0
    for p in params:
        if units and used + p.numel() <= bucket_numel:
            units[-1].append(p)
            used += p.numel()
        else:
            units.append([p])
            used = p.numel()
    return units


def build_layout(
    param_groups: Sequence[Sequence[torch.nn.Parameter]],
    *,
    registration: Mapping[torch.nn.Parameter, int],
    names: Mapping[torch.nn.Parameter, str],
    num_shards: int | Sequence[int],
    bucket_numel: int,
) -> list[FlatGroup]:
    """Pack each group's parameters into a flat buffer (see [Note: flat layout]).

    The parameters' data is copied in and each parameter becomes a view into its group's buffer.

    Args:
        param_groups: trainable parameters of each optimizer param group.
        registration: each parameter's index in ``model.parameters()``.
        names: each parameter's name in ``model.named_parameters()``.
        num_shards: ranks each unit is split across (1 when nothing is sharded), or one such
            count per group.
        bucket_numel: most elements per unit (``reduce_bucket_size``).

    Returns:
        One :class:`FlatGroup` per param group; units carry their global launch ``order``.
    """
    groups: list[FlatGroup] = []
    shards = [num_shards] * len(param_groups) if isinstance(num_shards, int) else num_shards
    for g, members in enumerate(param_groups):
        ordered = sorted(members, key=lambda p: -registration[p])
        units: list[FlatUnit] = []
        start = shard_start = 0
        for unit_params in _cut_units(ordered, bucket_numel):
            offsets, used = [], 0
            for p in unit_params:
                offsets.append(used)
                used += p.numel()
            unit = FlatUnit(
                group=g,
                params=unit_params,
                offsets=offsets,
                numel=used,
                padded_numel=padded_numel(used, shards[g]),
                start=start,
                shard_start=shard_start,
                num_shards=shards[g],
            )
            units.append(unit)
            start += unit.padded_numel
            shard_start += unit.shard_numel
        ref = ordered[0]
        flat = torch.zeros(start, dtype=ref.dtype, device=ref.device)
        group = FlatGroup(index=g, units=units, flat=flat, names=[names[p] for p in ordered])
        _alias_params(group)
        groups.append(group)
    # Launch order: the unit whose first gradient comes first in backward goes first.
    every = sorted(
        (u for grp in groups for u in grp.units), key=lambda u: -registration[u.params[0]]
    )
    for order, unit in enumerate(every):
        unit.order = order
    return groups


def _alias_params(group: FlatGroup) -> None:
    with torch.no_grad():
        for unit in group.units:
            for i, p in enumerate(unit.params):
                view = unit.param_view(group.flat, i)
                view.copy_(p.data)
                p.data = view
