"""Sharded checkpoints: each rank saves only its partition plus the layout needed to re-partition
it, and a checkpoint saved on N ranks loads on M.

[Note: resharding a checkpoint]
A rank's state holds its fp32 master partition, the optimizer's state (partition-sized tensors
such as Adam's moments, and scalars such as ``step``) and the layout that produced them: per
group, its units' padded sizes and each parameter's name, shape and offset. Loading on the same
world size with the same layout takes the rank's own file. Otherwise (``elastic_checkpoint``)
every old partition is read, each parameter's slice is cut out of the old units by name, and the
new partition is assembled from those slices for the new layout, so the world size, the bucket
sizes and even the parameter order may differ between save and load. Scalar state must be
identical on every rank (it is, as every rank steps the same number of times) and is taken from
rank 0. Optimizer state that is neither a scalar nor partition-sized cannot be resharded and is
an error (ZeRO needs an elementwise optimizer).

[Note: atomic checkpoint directories]
Ranks write into ``.<name>.partial`` next to the target; after a barrier rank 0 adds
``metadata.json`` and renames the directory into place (a previous checkpoint of that name is
moved aside first and then removed), so a crash leaves either the old checkpoint or the new one,
never a mix. All ranks must see the same file system, as with DeepSpeed.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import ds_comm
from ds_zero.api import ConfigError

if TYPE_CHECKING:
    from ds_zero._optimizer import ZeroOptimizer

__all__ = [
    "FORMAT",
    "load_sharded_checkpoint",
    "resolve_states",
    "save_sharded_checkpoint",
]

FORMAT = "ds_zero.sharded/1"
_METADATA = "metadata.json"
_CLIENT = "client_state.pt"


def _rank_file(rank: int) -> str:
    return f"zero_rank{rank:05d}.pt"


# --- resharding ----------------------------------------------------------------------------------


def _values_by_name(
    layout: Mapping[str, Any], parts: Sequence[torch.Tensor], num_shards: int
) -> dict[str, torch.Tensor]:
    """Each parameter's flat slice, cut out of the old partitions of one group."""
    values: dict[str, torch.Tensor] = {}
    for unit in layout["units"]:
        shard = unit["padded_numel"] // num_shards
        full = torch.cat([part.narrow(0, unit["shard_start"], shard) for part in parts])
        for name, shape, offset in unit["params"]:
            values[name] = full.narrow(0, offset, math.prod(shape))
    return values


def _assemble(
    layout: Mapping[str, Any],
    values: Mapping[str, torch.Tensor],
    *,
    num_shards: int,
    rank: int,
    like: torch.Tensor,
) -> torch.Tensor:
    """This rank's partition of one group under ``layout``, from per-parameter slices."""
    out = torch.zeros(layout["partition_numel"], dtype=like.dtype)
    for unit in layout["units"]:
        shard = unit["padded_numel"] // num_shards
        low, high = rank * shard, (rank + 1) * shard
        dst = out.narrow(0, unit["shard_start"], shard)
        for name, shape, offset in unit["params"]:
            begin, end = max(low, offset), min(high, offset + math.prod(shape))
            if begin < end:
                dst[begin - low : end - low].copy_(values[name][begin - offset : end - offset])
    return out


def _check_same_params(old: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> None:
    if len(old) != len(new):
        raise ValueError(
            f"checkpoint has {len(old)} parameter groups, the optimizer has {len(new)}; build the "
            "optimizer with the same param groups it was saved with"
        )
    for g, (a, b) in enumerate(zip(old, new)):
        shapes_a = {n: tuple(s) for u in a["units"] for n, s, _ in u["params"]}
        shapes_b = {n: tuple(s) for u in b["units"] for n, s, _ in u["params"]}
        if shapes_a != shapes_b:
            diff = sorted(set(shapes_a.items()) ^ set(shapes_b.items()))[:4]
            raise ValueError(
                f"parameter group {g} differs between the checkpoint and the model; (name, "
                f"shape) pairs found in only one of them: {diff}"
            )


def resolve_states(
    states: Sequence[Mapping[str, Any]],
    *,
    layouts: Sequence[Mapping[str, Any]],
    num_shards: int,
    rank: int,
    elastic: bool,
) -> tuple[list[torch.Tensor], dict[str, Any], Mapping[str, Any]]:
    """This rank's masters and optimizer state dict from saved rank states (see
    [Note: resharding a checkpoint]).

    Args:
        states: this rank's saved state, or every saved rank's state (needed to reshard).
        layouts: the current layout, ``FlatGroup.describe()`` per group.
        num_shards: the current number of shards.
        rank: this rank's index in the data-parallel group.
        elastic: ``zero_optimization.elastic_checkpoint``.

    Returns:
        ``(masters, optimizer state dict, the state the scalars came from)``.
    """
    first = states[0]
    if first.get("format") != FORMAT:
        raise ValueError(f"not a ds-zero sharded state (format {first.get('format')!r})")
    old_shards = int(first["num_shards"])
    _check_same_params(first["layout"], layouts)
    if old_shards == num_shards and list(first["layout"]) == list(layouts):
        own = next((s for s in states if s["rank"] == rank or old_shards == 1), None)
        if own is None:
            raise ValueError(
                f"no saved state for rank {rank} among ranks {[s['rank'] for s in states]}"
            )
        masters = list(own["masters"])
        return masters, own["optimizer"], own
    if old_shards != num_shards and not elastic:
        raise ConfigError(
            f"the checkpoint was saved with {old_shards} optimizer partitions and this run has "
            f"{num_shards}; set zero_optimization.elastic_checkpoint to true to re-partition it"
        )
    by_rank = {int(s["rank"]): s for s in states}
    if old_shards > 1 and sorted(by_rank)[:old_shards] != list(range(old_shards)):
        raise ValueError(
            f"resharding needs the states of all {old_shards} saved ranks, got {sorted(by_rank)}"
        )
    old = [by_rank[r] for r in range(old_shards)] if old_shards > 1 else [first]
    masters, optimizer_state = _reshard(old, layouts, num_shards=num_shards, rank=rank)
    return masters, optimizer_state, first


def _reshard(
    old: Sequence[Mapping[str, Any]],
    layouts: Sequence[Mapping[str, Any]],
    *,
    num_shards: int,
    rank: int,
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Masters and optimizer state for ``rank`` under ``layouts``, from every old rank's state."""
    first, old_shards = old[0], int(old[0]["num_shards"])
    masters = []
    state: dict[int, dict[str, Any]] = {}
    for g, layout in enumerate(layouts):
        old_layout = first["layout"][g]

        def repartition(parts: Sequence[torch.Tensor], layout=layout, old_layout=old_layout):
            values = _values_by_name(old_layout, parts, old_shards)
            return _assemble(layout, values, num_shards=num_shards, rank=rank, like=parts[0])

        masters.append(repartition([s["masters"][g] for s in old]))
        saved = first["optimizer"]["state"].get(g)
        if saved is None:
            continue
        state[g] = {}
        for name, value in saved.items():
            sharded = isinstance(value, torch.Tensor) and value.dim() == 1
            if sharded and value.numel() == old_layout["partition_numel"]:
                state[g][name] = repartition([s["optimizer"]["state"][g][name] for s in old])
            elif not isinstance(value, torch.Tensor) or value.numel() == 1:
                state[g][name] = value
            else:
                raise ValueError(
                    f"optimizer state {name!r} of shape {tuple(value.shape)} is neither a scalar "
                    "nor partition-sized, so it cannot be re-partitioned (ZeRO needs an "
                    "elementwise optimizer)"
                )
    return masters, {"state": state, "param_groups": first["optimizer"]["param_groups"]}


# --- checkpoint directories ----------------------------------------------------------------------


def _barrier(pg: Any) -> None:
    if dist.is_available() and dist.is_initialized():
        ds_comm.barrier(group=pg)


def save_fsynced(obj: Any, path: Path) -> None:
    """``torch.save`` ``obj`` to ``path`` and fsync it, so a later rename publishes whole bytes."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def save_sharded_checkpoint(
    path: str | os.PathLike[str],
    optimizer: ZeroOptimizer,
    *,
    client_state: Mapping[str, Any] | None = None,
) -> Path:
    """Save every rank's partition into the directory ``path``, atomically.

    Every rank of the data-parallel group must call it. See [Note: atomic checkpoint
    directories].

    Args:
        path: the checkpoint directory (replaced if it exists).
        optimizer: the :class:`~ds_zero.ZeroOptimizer` to save.
        client_state: anything else to keep (saved once, by rank 0): tensors and plain Python
            values only, since loading never unpickles code (``weights_only=True``).

    Returns:
        The checkpoint directory.

    Example:
        >>> save_sharded_checkpoint("ckpt/step100", zero_opt, client_state={"step": 100})
    """
    target = Path(path)
    partial = target.with_name(f".{target.name}.partial")
    rank, pg = optimizer.rank, optimizer.group
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    _barrier(pg)
    state = optimizer.state_dict()
    files = _state_files(optimizer)
    writes = rank < len(files)  # unsharded state is the same on every rank: rank 0 writes it
    if writes:
        save_fsynced(state, partial / _rank_file(rank))
    _barrier(pg)
    if rank == 0:
        if client_state is not None:
            save_fsynced(dict(client_state), partial / _CLIENT)
        metadata = {
            "format": FORMAT,
            "stage": optimizer.config.stage,
            "world_size": optimizer.world_size,
            "num_shards": optimizer.num_shards,
            "files": files,
            "layout": state["layout"],
        }
        (partial / _METADATA).write_text(json.dumps(metadata, indent=1))
        replace_dir(partial, target)
    _barrier(pg)
    return target


def _state_files(optimizer: ZeroOptimizer) -> list[str]:
    """One file per rank when ranks hold different state (sharded, or own process groups)."""
    per_rank = optimizer.num_shards > 1 or optimizer.own_groups
    return [_rank_file(r) for r in range(optimizer.world_size if per_rank else 1)]


def replace_dir(partial: Path, target: Path) -> None:
    """Move the finished directory ``partial`` onto ``target``, replacing any old one, and fsync the
    parent. See [Note: atomic checkpoint directories]."""
    aside = target.with_name(f".{target.name}.old")
    shutil.rmtree(aside, ignore_errors=True)
    if target.exists():
        target.rename(aside)
    partial.rename(target)
    shutil.rmtree(aside, ignore_errors=True)
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_sharded_checkpoint(
    path: str | os.PathLike[str], optimizer: ZeroOptimizer
) -> dict[str, Any] | None:
    """Load a directory written by :func:`save_sharded_checkpoint`, on any world size.

    Reads only this rank's file when the world size and layout match; otherwise every rank file
    is read and re-partitioned (needs ``elastic_checkpoint``). Every rank must call it.

    Returns:
        The ``client_state`` saved with the checkpoint, or None.

    Example:
        >>> client = load_sharded_checkpoint("ckpt/step100", zero_opt)
    """
    source = Path(path)
    metadata = json.loads((source / _METADATA).read_text())
    if metadata.get("format") != FORMAT:
        raise ValueError(f"{source} is not a ds-zero sharded checkpoint")
    same = metadata["num_shards"] == optimizer.num_shards and metadata["layout"] == [
        g.describe() for g in optimizer.groups
    ]
    if same:
        file = metadata["files"][optimizer.rank if len(metadata["files"]) > 1 else 0]
        states = [torch.load(source / file, map_location="cpu", weights_only=True)]
    else:
        states = [
            torch.load(source / f, map_location="cpu", weights_only=True) for f in metadata["files"]
        ]
    optimizer.load_state_dict(states)
    client = source / _CLIENT
    return torch.load(client, map_location="cpu", weights_only=True) if client.exists() else None
