"""Sharded checkpoints: each rank writes only what it holds, rank 0 writes a manifest, and any
world size and ZeRO stage loads it (see [Note: universal checkpoint manifest]).

[Note: atomic checkpoint directories]
Ranks write into ``.<name>.partial`` next to the target; after every rank's file is written rank
0 adds the scalars, the client state and ``manifest.json`` (sealed, through a rename: a
directory is complete exactly when its manifest is whole and sealed) and renames the directory
into place (a previous checkpoint of that name is first moved aside to ``.<name>.old``, then
removed manifest first). A crash between the two renames leaves no ``<name>``: loading then uses
the finished ``.partial`` (or else the ``.old``) with a warning (:func:`recover_directory`), and
the next save first puts that copy back (:func:`repair_directory`) so it never deletes the only
complete copy. A crash anywhere therefore leaves the old checkpoint or the new one, never a mix
and never none. All ranks must see the same file system, as with DeepSpeed.

[Note: universal save and load]
Saving asks the optimizer for its :class:`~ds_zero._shards.TensorShard` records
(``checkpoint_shards()``, or ``_zero_shards`` for a :class:`~ds_zero.ZeroOptimizer`), writes
their values into the rank's file, gathers every rank's piece list with one
``all_gather_object`` and checks that the pieces cover every tensor exactly once before anything
is published. Loading verifies files and coverage first (every rank the same verdict, so ranks
fail together instead of hanging), then hands the optimizer a lookup of any element range
(``load_checkpoint_shards(lookup)``), which reads only the pages holding that range. Scalars
(param-group hyper-parameters, scalar optimizer state such as ``step``, the loss scaler and the
step counters) are identical on every rank and saved once, by rank 0, in ``scalars.pt``.

[Note: resharding a checkpoint]
The per-rank format (``metadata.json`` + ``zero_rank{r:05d}.pt``, each a
:meth:`ZeroOptimizer.state_dict`) is still written for optimizers whose param groups have their
own process groups (MoE experts: ranks hold different values under the same names) and read
for directories saved by earlier releases. A rank's state holds its fp32 master partition, the
optimizer's state and the layout that produced them: per group, its units' padded sizes and each
parameter's name, shape and offset. Loading on the same world size with the same layout takes
the rank's own file. Otherwise (``elastic_checkpoint``) every old partition is read, each
parameter's slice is cut out of the old units by name and the new partition is assembled.
Scalar state is taken from rank 0. Optimizer state that is neither a scalar nor
partition-sized cannot be resharded and is an error (ZeRO needs an elementwise optimizer).

[Note: reading the copies after the verdict]
A full load read its ranges out of the shard files' mappings into new tensors before the
verdict, while a checksum thread hashed the same files from mappings of its own: two passes
over every byte, at once, on a machine whose two cores share one memory bus (on the 2-core VM
the loader's copies of a 10M-parameter ZeRO-2 load took about 9 ms more with the thread running
than without), and every page faulted into two mappings. Now a shard file hashed from the page
cache is copied out as it is hashed (ds-zero's [Note: copying while verifying]), as a
masters-only load's files are, and a rank holding such copies waits for the verdict before it
reads: each range one piece holds is then a view of the verified copy (``ShardReader(copied=
...)``), copied once into the optimizer's new buffers. The bytes used are the bytes hashed.
Each rank checks its own shard file (``share``), the one it reads when loading on the world
size that saved it. Loaded on that world size, the pieces are copied straight into the
optimizer's new buffers (``_zero_shards.py``'s [Note: copying the pieces into the optimizer's
buffers]): no memory beyond the load's own, and no budget. Otherwise the copies are the
check's own (up to ``COPY_AHEAD_BYTES`` a load, beside the state being assembled), made once
the loader has mapped the file where it is not in the page cache (``_integrity.py``'s [Note:
hashing ahead of the loader]); past that budget the file is hashed in place and read before
the verdict, as before.

Reading after the verdict moves a reading failure (a weight the checkpoint lacks: a model that
does not fit) past the collective that told every rank of the others' failures. So a rank that
reads after it says so at the verdict (``wait(reads_after=True)``, in the same all_gather), and
then every rank, however it read, calls ``agree_reads`` once after its reads: one more
all_gather, only where some rank reads after the verdict, so that a failure on one rank is
every rank's error and none waits in the next collective.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

import ds_comm
from ds_zero._integrity import DIRECTORY_MANIFEST, PendingVerification, is_complete
from ds_zero._manifest import (
    INDEX,
    MANIFEST,
    SettlingLookup,
    ShardReader,
    binding_problems,
    build_manifest,
    coverage_problems,
    file_problems,
    read_manifest,
    shard_file,
    write_hashed,
    write_manifest,
)
from ds_zero._ranks import agree, ranks_in
from ds_zero._sealed import (
    CheckpointError,
    load_file,
    read_sealed,
    write_sealed,
)
from ds_zero._shards import ShardLookup, TensorShard
from ds_zero.api import ConfigError

if TYPE_CHECKING:
    from ds_zero._optimizer import ZeroOptimizer

__all__ = [
    "FORMAT",
    "load_sharded_checkpoint",
    "recover_directory",
    "repair_directory",
    "replace_dir",
    "resolve_states",
    "restore_scalar_state",
    "save_fsynced",
    "save_sharded_checkpoint",
    "scalar_state",
    "verify_checkpoint",
]

FORMAT = "ds_zero.sharded/1"
_METADATA = "metadata.json"
_CLIENT = "client_state.pt"
_SCALARS = "scalars.pt"


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


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard(directory: Path) -> None:
    """Remove ``directory``, its manifests first: a crash midway leaves it visibly incomplete."""
    for name in (DIRECTORY_MANIFEST, MANIFEST, _METADATA):
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            (directory / name).unlink()
    shutil.rmtree(directory, ignore_errors=True)


def _aside(target: Path) -> Path:
    return target.with_name(f".{target.name}.old")


def _partial(target: Path) -> Path:
    return target.with_name(f".{target.name}.partial")


def replace_dir(partial: Path, target: Path) -> None:
    """Move the finished directory ``partial`` onto ``target``, replacing any old one, and fsync the
    parent. See [Note: atomic checkpoint directories]."""
    aside = _aside(target)
    if target.exists():
        _discard(aside)
        target.rename(aside)
    partial.rename(target)
    _fsync_dir(target.parent)
    _discard(aside)


def recover_directory(target: Path, manifest: str = DIRECTORY_MANIFEST) -> Path | None:
    """``target`` when it exists; otherwise the newest complete copy a crash left beside it
    (``.<name>.partial`` finished but not yet renamed, then ``.<name>.old`` moved aside), with a
    warning; None when there is none. A copy is complete when its ``manifest`` is whole and
    sealed. See [Note: atomic checkpoint directories]."""
    if target.is_dir():
        return target
    for candidate, what in ((_partial(target), "finished"), (_aside(target), "previous")):
        if candidate.is_dir() and is_complete(candidate, manifest):
            warnings.warn(
                f"checkpoint {str(target)!r} is missing (a save was interrupted while replacing "
                f"it); using the {what} complete copy {str(candidate)!r}",
                stacklevel=2,
            )
            return candidate
    return None


def repair_directory(target: Path, manifest: str = DIRECTORY_MANIFEST) -> None:
    """Put the copy :func:`recover_directory` finds back under ``target`` (one process only,
    before saving there again, so the next save never deletes the only complete copy)."""
    if target.is_dir():
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = recover_directory(target, manifest)
    if found is not None:
        found.rename(target)
        _fsync_dir(target.parent)


def _topology(optimizer: Any) -> tuple[int, int, Any]:
    """``(rank, world_size, group)`` of the optimizer's data-parallel group."""
    group = getattr(optimizer, "group", None)
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1, None
    mics = getattr(optimizer, "mics", None)  # stage 3 over MiCS shard groups: save over all
    if mics is not None:
        return mics.rank, mics.world_size, mics.group
    rank = getattr(optimizer, "rank", None)
    world = getattr(optimizer, "world_size", None)
    if rank is None or world is None:
        rank, world = ds_comm.get_rank(group), ds_comm.get_world_size(group)
    return int(rank), int(world), group


def _all_gather_object(obj: Any, group: Any, world_size: int) -> list[Any]:
    if world_size == 1:
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out


# --- what an optimizer holds -----------------------------------------------------------------------


def _is_legacy(optimizer: Any) -> bool:
    """ZeroOptimizers with per-group process groups keep the per-rank format."""
    return bool(getattr(optimizer, "own_groups", False))


def _shards_of(optimizer: Any) -> list[TensorShard]:
    if not hasattr(optimizer, "checkpoint_shards"):
        raise TypeError(
            f"a {type(optimizer).__name__} cannot be saved as a sharded checkpoint: pass a "
            "ZeRO optimizer (or an object with checkpoint_shards() and "
            "load_checkpoint_shards(lookup))"
        )
    return list(optimizer.checkpoint_shards())


def _load_shards(optimizer: Any, lookup: ShardLookup) -> None:
    if not hasattr(optimizer, "load_checkpoint_shards"):
        raise TypeError(
            f"a {type(optimizer).__name__} cannot load a sharded checkpoint: pass a ZeRO "
            "optimizer (or an object with checkpoint_shards() and load_checkpoint_shards(lookup))"
        )
    from ds_zero._optimizer import ZeroOptimizer  # the layouts' modules import this one
    from ds_zero._stage3_optimizer import Stage3Optimizer

    if isinstance(lookup, SettlingLookup) and type(optimizer) not in (
        ZeroOptimizer,
        Stage3Optimizer,
    ):
        lookup.settle()  # only ds-zero's own layouts settle between reading and writing
    optimizer.load_checkpoint_shards(lookup)
    if isinstance(lookup, SettlingLookup):
        lookup.settle()  # a no-op once settled


_COUNTERS = ("micro_steps", "global_steps", "skipped_steps")


def scalar_state(optimizer: Any) -> dict[str, Any]:
    """What is the same on every rank: each param group's hyper-parameters and scalar optimizer
    state (``step``), the loss scaler's state and the step counters."""
    inner = getattr(optimizer, "optimizer", None)
    states: Mapping[Any, Any] = inner.state if inner is not None else {}
    groups = []
    for group in optimizer.param_groups:
        scalars: dict[str, Any] = {}
        for p in group["params"]:
            for key, value in states.get(p, {}).items():
                if not torch.is_tensor(value):
                    scalars.setdefault(key, value)
                elif value.dim() == 0:
                    scalars.setdefault(key, value.detach().to("cpu", copy=True))
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({"hyper": hyper, "state": scalars})
    scaler = getattr(optimizer, "loss_scaler", None)
    return {
        "param_groups": groups,
        "loss_scaler": scaler.state_dict() if scaler is not None else None,
        "counters": {k: int(getattr(optimizer, k)) for k in _COUNTERS if hasattr(optimizer, k)},
    }


def restore_scalar_state(optimizer: Any, saved: Mapping[str, Any]) -> None:
    """Put :func:`scalar_state` back (after the optimizer's elementwise state was loaded)."""
    groups = saved["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint has {len(groups)} parameter groups, the optimizer has "
            f"{len(optimizer.param_groups)}; build the optimizer with the groups it was saved with"
        )
    inner = getattr(optimizer, "optimizer", None)
    for group, entry in zip(optimizer.param_groups, groups):
        group.update(entry["hyper"])
        if inner is None or not entry["state"]:
            continue
        for p in group["params"]:
            state = inner.state[p]
            for key, value in entry["state"].items():
                state[key] = value.clone() if torch.is_tensor(value) else value
    scaler = getattr(optimizer, "loss_scaler", None)
    if scaler is not None and saved.get("loss_scaler") is not None:
        scaler.load_state_dict(saved["loss_scaler"])
    for key, value in saved.get("counters", {}).items():
        if hasattr(optimizer, key):
            setattr(optimizer, key, int(value))


def _names_and_aliases(optimizer: Any) -> tuple[list[str], dict[str, str]]:
    """Parameter names in model order, and each tied name's first name."""
    module = getattr(optimizer, "module", None)
    if not isinstance(module, torch.nn.Module):
        return [], {}
    first: dict[int, str] = {}
    order, aliases = [], {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
            order.append(name)
    return order, aliases


# --- save ------------------------------------------------------------------------------------------


def save_sharded_checkpoint(
    path: str | os.PathLike[str],
    optimizer: Any,
    *,
    client_state: Mapping[str, Any] | None = None,
) -> Path:
    """Save every rank's shards into the directory ``path``, atomically, with a verified manifest.

    Every rank of the data-parallel group must call it. See [Note: universal save and load] and
    [Note: atomic checkpoint directories].

    Args:
        path: the checkpoint directory (replaced if it exists).
        optimizer: a :class:`~ds_zero.ZeroOptimizer`, or any object with
            ``checkpoint_shards()`` and ``load_checkpoint_shards(lookup)`` (stage 3).
        client_state: anything else to keep (saved once, by rank 0): tensors and plain Python
            values only, since loading never unpickles code (``weights_only=True``).

    Returns:
        The checkpoint directory.

    Raises:
        CheckpointError: the ranks' pieces do not cover every tensor exactly once (nothing is
            published then).

    Example:
        >>> save_sharded_checkpoint("ckpt/step100", zero_opt, client_state={"step": 100})
    """
    target = Path(path)
    if _is_legacy(optimizer):
        return _save_per_rank(target, optimizer, client_state)
    partial = _partial(target)
    rank, world, pg = _topology(optimizer)
    if rank == 0:
        repair_directory(target, MANIFEST)
        _discard(partial)
        partial.mkdir(parents=True)
    _barrier(pg)
    values: dict[str, Any] = {INDEX: {}}
    pieces = []
    for i, shard in enumerate(_shards_of(optimizer)):
        if shard.numel <= 0:
            continue
        for value, tensor in shard.values.items():
            values[f"p{i}/{value}"] = tensor.detach().to("cpu", torch.float32, copy=True)
        values[INDEX][f"p{i}"] = [shard.name, shard.start, shard.stop]
        pieces.append(
            {
                "name": shard.name,
                "shape": list(shard.shape),
                "dtype": str(shard.dtype),
                "values": sorted(shard.values),
                "key": f"p{i}",
                "start": shard.start,
                "stop": shard.stop,
            }
        )
    record = write_hashed(values, partial / shard_file(rank))
    del values
    payload = {"file": shard_file(rank), **record, "pieces": pieces}
    payloads = _all_gather_object(payload, pg, world)
    order, aliases = _names_and_aliases(optimizer)
    stage = getattr(getattr(optimizer, "config", None), "stage", None)
    manifest: dict[str, Any] = {}
    try:  # the same verdict on every rank: all raise together
        manifest = build_manifest(payloads, stage=stage, order=order, aliases=aliases)
        problems = coverage_problems(manifest)
    except CheckpointError as exc:
        problems = [str(exc)]
    if problems:
        _barrier(pg)
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(_unusable(target, problems, "was not saved"))
    if rank == 0:
        manifest["files"][_SCALARS] = write_hashed(scalar_state(optimizer), partial / _SCALARS)
        if client_state is not None:
            manifest["files"][_CLIENT] = write_hashed(dict(client_state), partial / _CLIENT)
        write_manifest(manifest, partial / MANIFEST)
        replace_dir(partial, target)
    _barrier(pg)
    return target


def _unusable(path: Path, problems: list[str], verdict: str) -> str:
    shown = problems[:8]
    more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    return f"checkpoint {str(path)!r} {verdict}:\n  " + "\n  ".join(shown) + more


def _save_per_rank(
    target: Path, optimizer: ZeroOptimizer, client_state: Mapping[str, Any] | None
) -> Path:
    """The per-rank format (see [Note: resharding a checkpoint])."""
    partial = _partial(target)
    rank, pg = optimizer.rank, optimizer.group
    if rank == 0:
        repair_directory(target, _METADATA)
        _discard(partial)
        partial.mkdir(parents=True)
    _barrier(pg)
    state = optimizer.state_dict()
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
            "files": [_rank_file(r) for r in range(optimizer.world_size)],
            "layout": state["layout"],
        }
        write_sealed(metadata, partial / _METADATA)
        replace_dir(partial, target)
    _barrier(pg)
    return target


# --- load ------------------------------------------------------------------------------------------


def verify_checkpoint(
    path: str | os.PathLike[str],
    *,
    group: Any = None,
    files: bool = True,
    pending: PendingVerification | None = None,
    opened: dict[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Check a checkpoint directory: the manifest sealed, every file present with its size and
    checksums, every piece bound to the tensor range its file records, every element of every
    tensor covered exactly once. With a process group each rank checks a share of the files and
    every rank gets the same verdict (every rank must call it then). This is the check every
    load path runs first (:func:`load_sharded_checkpoint`, ``consolidate``, universal loading).

    Args:
        path: the directory holding ``manifest.json``.
        group: the ranks verifying together (None: the default group, or one process).
        files: False skips the file checksums (already verified by a directory manifest above,
            see :func:`~ds_zero._integrity.verify_directory`); the rest is still checked.
        pending: the directory manifest's check, still running: a problem found here waits
            for its verdict too, so the error names a damaged file as such.
        opened: the shard files the binding check mapped and unpickled are left here, for a
            :class:`~ds_zero._manifest.ShardReader` of the same load (one parse per file).

    Returns:
        The manifest.

    Raises:
        CheckpointError: naming each tensor, element range and file that is lost.

    Example:
        >>> verify_checkpoint("ckpt/step100")["world_size"]
    """
    source = Path(path)
    rank, world = ranks_in(group)
    manifest: dict[str, Any] = {}
    try:
        manifest = read_manifest(source)
        mine = sorted(manifest["files"])[rank::world]
        problems = file_problems(source, manifest, rank=rank, world_size=world) if files else []
        problems += binding_problems(source, manifest, mine, opened)
    except CheckpointError as exc:
        problems = [str(exc)]
    problems = list(dict.fromkeys(agree(problems, group)))
    if problems and pending is not None:
        pending.wait(problems)  # raises, with the checksums' verdict
    if problems and not manifest:
        raise CheckpointError(problems[0])
    problems += coverage_problems(manifest) if manifest else []
    if problems and pending is not None:
        pending.wait(problems)
    if problems:
        raise CheckpointError(_unusable(source, problems, "cannot be loaded"))
    return manifest


def load_sharded_checkpoint(
    path: str | os.PathLike[str],
    optimizer: Any,
    *,
    verified: bool | PendingVerification = False,
    before_apply: Callable[[], None] | None = None,
) -> dict[str, Any] | None:
    """Load a directory written by :func:`save_sharded_checkpoint`, on any world size and stage.

    The directory is verified first (:func:`verify_checkpoint`); then each rank reads just the
    element ranges it holds. With ``load_from_fp32_weights`` (the default) the model's parameters
    are rebuilt from the saved fp32 masters, so the checkpoint restores the model too. Every rank
    must call it. A directory missing because a save was interrupted while replacing it is found
    beside it (see :func:`recover_directory`).

    Args:
        path: the checkpoint directory.
        optimizer: the optimizer to load into.
        verified: the files were already checked against a directory manifest (ds-engine's),
            or are being checked (a :class:`~ds_zero.PendingVerification`: its verdict is
            waited for after the values are read and before any is written, see [Note:
            verification overlapped with reading]); the manifest's seal, bindings and coverage
            are still checked.
        before_apply: called once the files are verified, before any value is written (the
            caller's own writes that must precede the optimizer's go there).

    Returns:
        The ``client_state`` saved with the checkpoint, or None.

    Raises:
        CheckpointError: the directory is partial, corrupted or duplicated, or does not fit.

    Example:
        >>> client = load_sharded_checkpoint("ckpt/step100", zero_opt)
    """
    source = recover_directory(Path(path), MANIFEST) or Path(path)
    if (source / _METADATA).is_file() and not (source / MANIFEST).is_file():
        if isinstance(verified, PendingVerification):
            verified.wait()
        if before_apply is not None:
            before_apply()
        return _load_per_rank(source, optimizer)
    if _is_legacy(optimizer):
        raise CheckpointError(
            f"{str(source)!r} is a universal checkpoint, but param groups with their own process "
            "groups (MoE experts) load only from the per-rank format they save"
        )
    try:
        manifest = _verify_and_load(source, optimizer, verified, before_apply)
    finally:  # the buffers staged for this load (shard_destinations): taken, or unwanted now
        layout = getattr(optimizer, "layout", None)
        if hasattr(layout, "_load_buffers"):
            layout._load_buffers = None  # type: ignore[union-attr]
    restore_scalar_state(optimizer, load_file(source / _SCALARS))
    client = source / _CLIENT
    return load_file(client) if _CLIENT in manifest["files"] else None


def _verify_and_load(
    source: Path,
    optimizer: Any,
    verified: bool | PendingVerification,
    before_apply: Callable[[], None] | None,
) -> dict[str, Any]:
    """:func:`load_sharded_checkpoint`'s check and read of ``source`` (a sharded directory);
    returns its manifest."""
    _, _, pg = _topology(optimizer)
    pending = verified if isinstance(verified, PendingVerification) else None
    opened: dict[str, Mapping[str, Any]] = {}  # each shard file parsed once, checked and read
    manifest = verify_checkpoint(
        source, group=pg, files=not verified, pending=pending, opened=opened
    )
    on_open = pending.hash_loaded if pending is not None else None
    for file, stored in opened.items():  # the checksums hash what the binding check mapped
        if on_open is not None:
            on_open(source / file, stored)
    copied = pending.verified_copy if pending is not None else None
    reader = ShardReader(source, manifest, opened, on_open, copied)
    # Shard files copied as hashed are read after the verdict, from the copies (see [Note:
    # reading the copies after the verdict]).
    after = pending is not None and any(pending.copying(source / f) for f in manifest["files"])
    if pending is not None and after:
        pending.wait(reads_after=True)

    def settle(failure: BaseException | None) -> None:
        if pending is not None:
            if not after:
                pending.wait([f"{source.name}: {failure}"] if failure is not None else [])
            pending.agree_reads(failure)  # where some rank reads after the verdict
        if failure is None and before_apply is not None:
            before_apply()

    try:
        _load_shards(optimizer, SettlingLookup(reader.lookup, settle))
    finally:
        reader.close()
    return manifest


def _load_per_rank(source: Path, optimizer: ZeroOptimizer) -> dict[str, Any] | None:
    metadata = read_sealed(source / _METADATA, "checkpoint metadata")
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{source} is not a ds-zero sharded checkpoint")
    same = metadata["num_shards"] == optimizer.num_shards and metadata["layout"] == [
        g.describe() for g in optimizer.groups
    ]
    if same:
        file = metadata["files"][optimizer.rank if len(metadata["files"]) > 1 else 0]
        states = [load_file(source / file)]
    else:
        states = [load_file(source / f) for f in metadata["files"]]
    optimizer.load_state_dict(states)
    client = source / _CLIENT
    return load_file(client) if client.exists() else None
