"""``ZeroOptimizer`` (stages 0-2) described as :class:`~ds_zero._shards.TensorShard` records and
restored from any :data:`~ds_zero._shards.ShardLookup`, for universal checkpoints.

[Note: tensor shards of the flat layout]
A rank owns slice ``[r * s, (r + 1) * s)`` of every unit (``s`` = the unit's shard size, see
[Note: flat layout]); a parameter at offset ``o`` with ``n`` elements overlaps it in
``[max(r * s, o), min((r + 1) * s, o + n))``, which is the parameter's range
``[max(r * s, o) - o, ...)`` and, in the rank's master partition, starts at the unit's
``shard_start`` plus ``max(r * s, o) - r * s``. Padding never overlaps a parameter, so it never
reaches a shard. Stage 0 holds everything on every rank: rank ``r`` reports the ``r``-th of ``N``
even pieces of each parameter (``[n * r // N, n * (r + 1) // N)``), so the ranks together cover
each element once and share the writing. Loading asks the lookup for exactly the ranges the
rank's partition holds (all of every parameter for stage 0), whatever stage and world size
wrote them; elementwise optimizer state follows the same ranges as the masters.

[Note: copying the pieces into the optimizer's buffers]
A full load assembles each master's optimizer state (``exp_avg``, ...) range by range into new
buffers of the master's size, and the masters' values into ranges it copies after the verdict.
Reading the copies after the verdict (``_checkpoint.py``'s note) still copied each range once
on the loading thread, and held a copy of the whole shard file beside the buffers, so past
``COPY_AHEAD_BYTES`` (a 100M-parameter ZeRO-2 shard is 1.2 GB) it was not done at all. When
the checkpoint was saved on this world size and layout, every range this rank holds is one
piece of its own shard file, exactly; :func:`zero_shard_destinations` (and the stage-3
layout's ``shard_destinations``) then allocates those buffers before the check starts, one per
master and value ("param" included, a staging buffer for the masters), and names each piece's
place in them as the copy's destination (``start_verification(into=...)``, all or nothing per
file). The checksum threads copy every piece there as they hash it; the load takes the buffers
as its optimizer state (a range already in place is not copied: the lookup's view and the
target are the same memory) and copies the masters' staging into the masters after the
verdict. No memory beyond the load's own buffers, and no copy on the loading thread but the
masters'. The buffers are the load's until it ends (``_load_buffers``, dropped by
``load_sharded_checkpoint`` either way); nothing of the optimizer is written before the
verdict. Another world size, a stage-0 layout, NVMe-swapped or accelerator masters, MoE
groups: no destinations, and the load reads as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ds_zero._manifest import CheckpointError
from ds_zero._shards import (
    ShardLookup,
    TensorShard,
    read_then_settle,
    staged_pieces,
    write_range,
)

if TYPE_CHECKING:
    from ds_zero._flat_layout import FlatLayout
    from ds_zero._layout import FlatGroup

__all__ = ["zero_checkpoint_shards", "zero_load_checkpoint_shards", "zero_shard_destinations"]


def _check_supported(zero: FlatLayout, lookup: ShardLookup | None = None) -> None:
    """Param groups with their own process groups (MoE experts) hold different values under
    the same names on different ranks: only a lookup that resolves each rank's own names
    (``lookup.per_rank_names``, e.g. by global expert id) can fill them."""
    if zero.own_groups and not getattr(lookup, "per_rank_names", False):
        raise CheckpointError(
            "param groups with their own process groups (MoE experts) hold different values "
            "under the same names on different ranks; they are saved in the per-rank format"
        )


@contextlib.contextmanager
def _resident_state(zero: FlatLayout) -> Iterator[None]:
    """Optimizer state swapped in from NVMe for the duration (a no-op otherwise)."""
    swap = zero._swap  # the NVMe swap of the optimizer's state (package-internal)
    if swap is not None:
        swap.swap_in()
    try:
        yield
    finally:
        if swap is not None:
            swap.swap_out()


def _held_ranges(
    zero: FlatLayout, group: FlatGroup
) -> Iterator[tuple[str, torch.nn.Parameter, int, int, int]]:
    """``(name, param, start, stop, position in the master partition)`` of every parameter range
    this rank holds in ``group`` (see [Note: tensor shards of the flat layout])."""
    names = iter(group.names)
    rank = zero._shard_rank(group)  # the group's own process group's rank (MoE experts)
    for unit in group.units:
        low, high = rank * unit.shard_numel, (rank + 1) * unit.shard_numel
        for p, offset in zip(unit.params, unit.offsets):
            name = next(names)
            begin, end = max(low, offset), min(high, offset + p.numel())
            if begin < end:
                yield name, p, begin - offset, end - offset, unit.shard_start + begin - low


def _elementwise_state(zero: FlatLayout, master: torch.Tensor) -> dict[str, torch.Tensor]:
    state = zero.optimizer.state.get(master, {})
    return {
        key: value
        for key, value in state.items()
        if torch.is_tensor(value) and value.dim() == 1 and value.numel() == master.numel()
    }


def zero_checkpoint_shards(zero: FlatLayout) -> list[TensorShard]:
    """This rank's pieces of every trainable parameter: fp32 master values and elementwise
    optimizer state (views; copy them before the next step).

    Example:
        >>> sum(s.numel for s in zero_checkpoint_shards(zero))  # this rank's share
    """
    _check_supported(zero)
    shards: list[TensorShard] = []
    replicated = zero.num_shards == 1
    with _resident_state(zero):
        for group, master in zip(zero.groups, zero.masters):
            state = _elementwise_state(zero, master)
            for name, p, start, stop, at in _held_ranges(zero, group):
                if replicated:  # stage 0: an even 1/N of each parameter per rank
                    n, r, w = p.numel(), zero.rank, zero.world_size
                    start, stop, at = n * r // w, n * (r + 1) // w, at + n * r // w
                values = {"param": master.narrow(0, at, stop - start)}
                for key, value in state.items():
                    values[key] = value.narrow(0, at, stop - start)
                shards.append(TensorShard(name, tuple(p.shape), p.dtype, start, stop, values))
    for name, p in _frozen(zero):  # replicated: an even 1/N each, like stage 0
        n, r, w = p.numel(), zero.rank, zero.world_size
        start, stop = n * r // w, n * (r + 1) // w
        values = {"param": p.detach().reshape(-1).narrow(0, start, stop - start).float()}
        shards.append(TensorShard(name, tuple(p.shape), p.dtype, start, stop, values))
    return shards


def _frozen(zero: FlatLayout) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters outside the flat layout (``requires_grad=False``), by name."""
    trainable = {id(p) for group in zero.groups for p in group.params}
    return [(n, p) for n, p in zero.module.named_parameters() if id(p) not in trainable]


def zero_shard_destinations(
    zero: FlatLayout, manifest: Mapping[str, Any]
) -> dict[str, dict[str, torch.Tensor]]:
    """Where a full load's checksum threads may copy this rank's pieces of a checkpoint with
    zero manifest ``manifest`` as they hash them (see [Note: copying the pieces into the
    optimizer's buffers]): per shard file (its name in the zero folder), per tensor key
    (``<piece>/<value>``), a range of a new buffer of the master's size, one per value, which
    the next :func:`zero_load_checkpoint_shards` takes as its own. Empty (nothing staged)
    unless every range this rank holds is one piece of the checkpoint, exactly (saved on this
    world size and layout), and the masters are CPU memory of their own."""
    zero._load_buffers = None
    if zero._master_is_flat or zero._swap is not None or zero.own_groups:
        return {}
    ranges = (
        (name, start, stop, index, at)
        for index, group in enumerate(zero.groups)
        for name, _, start, stop, at in _held_ranges(zero, group)
    )
    found = staged_pieces(ranges, zero.masters, manifest)
    if found is None:
        return {}
    into, zero._load_buffers = found
    return into


def zero_load_checkpoint_shards(zero: FlatLayout, lookup: ShardLookup) -> None:
    """Restore the fp32 masters (with ``load_from_fp32_weights``; else they are rebuilt from
    the model's weights) and the elementwise optimizer state from ``lookup``, then write the
    masters into the model's parameters. Scalar state (``step``, hyper-parameters) is the
    caller's: it is not in the lookup.

    Everything is read into new tensors first; a lookup with a ``settle()`` (a
    :class:`~ds_zero._manifest.SettlingLookup`, whose checkpoint is still being verified) is
    settled before any value is written (see [Note: verification overlapped with reading])."""
    _check_supported(zero, lookup)
    masters, states, frozen = read_then_settle(lookup, lambda: _read_shards(zero, lookup))
    with torch.no_grad():
        for master, ranges in zip(zero.masters, masters):
            if ranges is not None:
                _write_ranges(master, ranges)
        _load_state(zero, states)
        for p, value in frozen:
            p.copy_(value)
        if zero.config.load_from_fp32_weights:
            zero._publish()  # masters -> parameters, gathered across ranks
        else:
            zero.refresh_fp32_params()
    zero.reducer.zero()


def _write_ranges(master: torch.Tensor, ranges: list[tuple[int, torch.Tensor]]) -> None:
    """Write each ``(position, values)`` into ``master`` and zero what no range covers (the
    padding): one copy from the lookup's tensors, no staging buffer of the master's size."""
    at = 0
    for start, values in sorted(ranges, key=lambda r: r[0]):
        if start > at:
            master.narrow(0, at, start - at).zero_()
        master.narrow(0, start, values.numel()).copy_(values)
        at = max(at, start + values.numel())
    if at < master.numel():
        master.narrow(0, at, master.numel() - at).zero_()


def _read_shards(
    zero: FlatLayout, lookup: ShardLookup
) -> tuple[
    list[list[tuple[int, torch.Tensor]] | None],
    list[dict[str, torch.Tensor]],
    list[tuple[torch.nn.Parameter, torch.Tensor]],
]:
    """This rank's ranges from ``lookup``, in new tensors: per master the loaded fp32 ranges
    as ``(position in the partition, values)`` (None without ``load_from_fp32_weights``; the
    lookup's own tensors, written into the master only after the verdict), its elementwise
    state, and the frozen parameters' values."""
    from_checkpoint = zero.config.load_from_fp32_weights
    masters: list[list[tuple[int, torch.Tensor]] | None] = []
    states: list[dict[str, torch.Tensor]] = []
    staged, zero._load_buffers = zero._load_buffers or [{} for _ in zero.groups], None
    for group, master, given in zip(zero.groups, zero.masters, staged):
        loaded: list[tuple[int, torch.Tensor]] | None = [] if from_checkpoint else None
        state: dict[str, torch.Tensor] = {}
        keys: set[str] | None = None
        for name, _, start, stop, at in _held_ranges(zero, group):
            values = lookup(name, start, stop)
            if "param" not in values:
                raise CheckpointError(f"tensor {name!r} has no 'param' values in the checkpoint")
            found = set(values) - {"param"}
            if keys is not None and found != keys:
                raise CheckpointError(
                    f"tensor {name!r} has optimizer state {sorted(found)} but other tensors "
                    f"of its param group have {sorted(keys)}; the checkpoint is inconsistent"
                )
            keys = found
            if loaded is not None:
                loaded.append((at, values["param"].reshape(-1)))
            for key in found:
                if key not in state:  # one buffer per value, not one per range
                    state[key] = given[key] if key in given else torch.zeros_like(master)
                write_range(state[key], at, values[key])
        masters.append(loaded)
        states.append(state)
    frozen = []
    for name, p in _frozen(zero):
        try:
            values = lookup(name, 0, p.numel())
        except CheckpointError:  # saved without it (it is the model's, not the optimizer's)
            continue
        frozen.append((p, values["param"].view(p.shape)))
    return masters, states, frozen


def _load_state(zero: FlatLayout, states: list[dict[str, torch.Tensor]]) -> None:
    """Replace the wrapped optimizer's state by ``states`` (one mapping per master); scalars
    such as ``step`` are restored after this by the caller."""
    inner = zero.optimizer
    with _resident_state(zero):
        for master, state in zip(zero.masters, states):
            inner.state.pop(master, None)
            if state:
                inner.state[master] = dict(state)
