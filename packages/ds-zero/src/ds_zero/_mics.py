"""MiCS at stage 3 (``mics_shard_size``): parameters, gradients and optimizer state sharded within
groups of ranks and replicated across them.

[Note: MiCS]
With ``mics_shard_size = m`` the data-parallel ranks are cut into *shard groups* of ``m``
consecutive ranks; ranks at the same place in different shard groups form a *replica group*
(``world / m`` ranks). Stage 3 runs over the shard group as if it were the whole data-parallel
group: parameters are partitioned into ``m`` shards (so a gather only reaches the ``m`` ranks of
a node, the point of MiCS), the masters and optimizer state are ``1/m`` of the model, and each
gradient bucket is reduce-scattered within the shard group. Then the reduced shard is
all-reduced over the replica group and divided by its size, so every replica holds the mean
gradient over all data-parallel ranks and takes the same step: replicas stay identical. The
model is broadcast from the first data-parallel rank before it is partitioned, so the replicas
start identical too. The global gradient norm is summed over the shard group only (a replica's
shards are the same values again). ``m`` equal to the data-parallel size is plain ZeRO-3.
A checkpoint is saved over the whole data-parallel group with the first shard group's pieces
only (the other replicas write empty files), so it is an ordinary sharded checkpoint that loads
on any world size, with or without MiCS.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

import ds_comm
from ds_zero.api import ZeroConfig

__all__ = ["MicsGroups"]


class _Reduced:
    """A shard-group reduction followed by the replica all-reduce; ``wait()`` completes both."""

    def __init__(self, inner: Any, finish: Callable[[], None]) -> None:
        self._inner, self._finish = inner, finish

    def wait(self) -> bool:
        if self._finish is not None:
            if self._inner is not None:
                self._inner.wait()
            self._finish()
            self._inner = self._finish = None  # type: ignore[assignment]
        return True


class MicsGroups:
    """This rank's MiCS shard and replica groups (see [Note: MiCS]).

    Args:
        group: the data-parallel group.
        shard_size: ``mics_shard_size``, a divisor of the group's size, at least 2.

    A collective: every rank of ``group`` constructs it (it creates every subgroup).
    """

    def __init__(self, group: Any, shard_size: int) -> None:
        ranks = ds_comm.get_all_ranks_from_group(group)
        world = len(ranks)
        if shard_size < 2 or world % shard_size:
            raise ValueError(
                f"zero_optimization.mics_shard_size = {shard_size} must be a divisor of the "
                f"data-parallel size {world} of at least 2 (1 would keep whole parameters on "
                "every rank: use ZeRO stage 1 or 2)"
            )
        self.group, self.shard_size, self.replicas = group, shard_size, world // shard_size
        me = dist.get_rank()
        local = world != dist.get_world_size()  # a data-parallel group of part of the world
        shards = [ranks[i : i + shard_size] for i in range(0, world, shard_size)]
        replicas = [ranks[i::shard_size] for i in range(shard_size)]
        self.shard_group = self.replica_group = None
        for members in shards + replicas:
            if local and me not in members:
                continue  # with local synchronisation only the members create a group
            made = dist.new_group(ranks=members, use_local_synchronization=local)
            if me in members and members in shards:
                self.shard_group = made
            elif me in members:
                self.replica_group = made
        self.source = ranks[0]
        self.rank, self.world_size = ranks.index(me), world  # in the data-parallel group
        self.replica = self.rank // shard_size  # which copy of the model this rank's group is

    @classmethod
    def build(cls, config: ZeroConfig, group: Any) -> MicsGroups | None:
        """The groups of ``config.mics_shard_size`` (None: MiCS is off, or the shard group is
        the whole data-parallel group, which is plain ZeRO-3)."""
        size = config.mics_shard_size
        if size <= 0 or size == ds_comm.get_world_size(group):
            return None
        return cls(group, size)

    def broadcast(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Give every replica the first data-parallel rank's values (before partitioning)."""
        with torch.no_grad():
            for p in params:
                if not hasattr(p, "ds_tensor"):
                    ds_comm.broadcast(p.data, self.source, group=self.group)

    def reduce(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        """``inner`` (a reduce-scatter over the shard group) followed by the mean over the
        replica group, with ``reduce_scatter_tensor``'s signature."""

        def reduce_scatter(
            out: torch.Tensor, send: torch.Tensor, *, group: Any = None, async_op: bool = False
        ) -> _Reduced:
            work = inner(out, send, group=group, async_op=async_op)

            def finish() -> None:
                ds_comm.all_reduce(out, group=self.replica_group)
                out.div_(self.replicas)

            handle = _Reduced(work, finish)
            if not async_op:
                handle.wait()
            return handle

        return reduce_scatter
