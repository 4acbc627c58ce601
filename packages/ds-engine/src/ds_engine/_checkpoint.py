"""Engine checkpoints in DeepSpeed's layout, written atomically and loaded without running code.

[Note: checkpoint layout and crash safety]
``save_dir/<tag>/`` holds ``mp_rank_<mp>_model_states.pt`` (the module's state dict, the engine's
counters, LR schedule, loader position and the client state; written by the first
data-parallel rank of each model-parallel slice), ``rng_state_rank<r>.pt`` (every rank's RNG
states) and ``zero/`` (or ``zero_mp<mp>/``), ds-zero's sharded optimizer checkpoint.
``save_dir/latest`` names the newest tag. Every file is written under ``save_dir/.<tag>.partial``
first; after a barrier every rank checksums a share of the files and global rank 0 writes
``ds_manifest.json`` (every file, every tensor; see ds-zero's [Note: checkpoint integrity]),
renames the directory to ``<tag>`` (moving an older one of that name aside) and only then
replaces ``latest`` through a fsynced temporary file and a rename. A rank killed at any point
leaves ``latest`` naming a complete checkpoint, or (killed between the two renames of a reused
tag) naming a tag whose finished copy sits in ``.<tag>.partial`` or ``.<tag>.old``: loading then
uses the newest complete copy with a warning, and the next save puts it back first.

Loading verifies the whole directory against ``ds_manifest.json`` before any value is used
(every load path: full, ``load_module_only``, ``load_optimizer_states=False``, and the pipeline
engine's), each rank checking a share of the files, every rank raising the same error naming
the file and tensor. The checksums run on threads while the model file and the optimizer's
ranges are read into memory of the loader's own; the verdict is waited for before anything is
written (ds-zero's [Note: verification overlapped with reading]). Every file read names the
file when it is absent or unreadable.

[Note: weights loaded into the masters]
A ZeRO-1/2 load without the optimizer's states put the model file's weights into the
parameters, then rebuilt the fp32 masters from them (``refresh_fp32_params``). Checked, the
checksum threads first copied the file into buffers of their own as they hashed it (ds-zero's
[Note: copying the file the loader reads whole]): three passes over the weights, where an
unchecked load that maps the file makes two, and on a machine that copies at memory speed that
pass was the check's whole cost (+48% on the 2-core VM at 10M parameters against
``tools/bench/checkpoint_verify.py --mapped-baseline``). Where the masters are fp32 memory of
their own on the CPU and the parameters are fp32 too, the threads now copy each weight this
rank's partition holds whole straight into its master as they hash it
(``ZeroOptimizer.master_views``, ds-zero's ``start_verification(into=...)``); after the verdict
the parameters are loaded from the masters (the state dict's tensors are views of them) and
only the masters not so written are rebuilt from the parameters
(``refresh_fp32_params(exclude=...)``: the parameters that straddle two ranks' partitions, or
every one on a rank whose share of the check does not include the model file). Two passes, as
unchecked, the first on the checksum threads, which the loading thread helps while it waits.

The masters are written before the verdict; the parameters, which the user's model is, are
not. The masters are the optimizer's own copy of the same fp32 values (the optimizer publishes
them into the parameters every step), so a load that fails, by a refused verdict or an error
after it, puts every master back from the parameters once the checksum threads have stopped
(``refresh_fp32_params()``): the model and its optimizer are left as they were. That is exact
only from fp32 parameters, so bf16 and fp16 models (whose file holds 16-bit weights, not the
fp32 the masters take, anyway) load as before, as do masters on an accelerator or on NVMe, a
``custom_load_fn`` and MoE models. It is all or nothing: one weight whose dtype or size in the
manifest is not its master's, and none is copied into the masters.

[Note: weights the masters overwrite]
A full ZeRO-1/2 load with ``load_from_fp32_weights`` (the default) set every parameter from the
model file, then every trainable one again from the saved fp32 masters (the optimizer publishes
them into the parameters), and checked the model file's copy of those weights first: a pass of
the checksum threads and one of the loading thread over bytes no value came from (8 of a 10M
-parameter load's 106 ms on the 2-core VM, and 24 ms of hashing). The load now names them
``unused`` to the check (ds-zero's ``start_verification(unused=...)``: neither hashed nor
copied; the bytes around them, the pickle included, still are) and drops them from the model
file's state dict, mapped and never read (``ZeroOptimizer.params_from_masters``; a tied weight
under all its keys). What is left of the file (buffers, frozen parameters) loads as before, and
the strict check still counts a trainable weight the file lacks. A dropped weight whose shape is
not its parameter's is refused at the verdict, by every rank together, as ``load_state_dict``
would have refused it after. A load that fails after the verdict leaves those parameters as
they were, where it left them holding the file's values.

[Note: weights-only checkpoints]
Everything is loaded with ``torch.load(weights_only=True)``: a file can hold tensors and plain
Python values only, so opening a checkpoint from an untrusted source runs no code. The client
state is therefore checked at save time: anything else (a module, an optimizer, a custom
object) is an error naming where it sits.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import sys
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import ds_comm
from ds_engine import __version__
from ds_engine._autotp import gather_tp_state_dict, tp_layout
from ds_engine._autotp_engine import is_autotp_model
from ds_engine._deepspeed_ckpt import deepspeed_tag_dir, load_deepspeed_checkpoint
from ds_engine._moe import (
    checkpoint_names_of,
    load_module_state,
    module_state,
    save_expert_files,
)
from ds_engine._moe_consolidate import whole_state_dict
from ds_zero import (
    CheckpointError,
    GatheredParameters,
    PendingVerification,
    Stage3Optimizer,
    ZeroOptimizer,
    iter_fp32_tensors,
    load_file,
    load_sharded_checkpoint,
    recover_directory,
    repair_directory,
    replace_dir,
    save_sharded_checkpoint,
    start_verification,
    verify_directory,
    write_directory_manifest,
    write_recovery_script,
)
from ds_zero import save_fsynced as _write  # module-level name: the crash test patches it

if TYPE_CHECKING:
    from ds_engine._engine import DeepSpeedEngine

__all__ = [
    "check_client_state",
    "load_checkpoint",
    "locate_checkpoint",
    "resolve_checkpoint",
    "save_16bit_model",
    "save_checkpoint",
    "tag_directory",
]

_LATEST = "latest"
_ZERO = (ZeroOptimizer, Stage3Optimizer)
_PLAIN = (bool, int, float, str, bytes, type(None), torch.dtype, torch.Size)


def check_client_state(value: Any, where: str = "client_state") -> None:
    """Raise TypeError unless ``value`` is tensors and plain values (see [Note: weights-only
    checkpoints])."""
    if isinstance(value, _PLAIN) or torch.is_tensor(value):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_client_state(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int, float, bool, type(None))):
                raise TypeError(f"{where} has a key {key!r} of type {type(key).__name__}")
            check_client_state(item, f"{where}[{key!r}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}: checkpoints hold "
        "only tensors and plain Python values (loading never runs code); save its state_dict()"
    )


def _barrier() -> None:
    if ds_comm.is_initialized():
        ds_comm.barrier()


def _check_same_tag(tag: str) -> None:
    """Every rank must save under the same tag: compare a checksum over all ranks."""
    if not ds_comm.is_initialized() or ds_comm.get_world_size() == 1:
        return
    mine = zlib.crc32(tag.encode())
    low = torch.tensor([mine], dtype=torch.int64)
    high = low.clone()
    ds_comm.all_reduce(low, op=ds_comm.ReduceOp.MIN)
    ds_comm.all_reduce(high, op=ds_comm.ReduceOp.MAX)
    if low.item() != high.item():
        raise ValueError(f"checkpoint tag {tag!r} differs between ranks; pass the same tag on all")


def _rng_state() -> dict[str, Any]:
    version, state, gauss = random.getstate()
    rng: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [version, list(state), gauss],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        kind, keys, pos, has_gauss, cached = sys.modules["numpy"].random.get_state()
        rng["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), pos, has_gauss, cached]
    return rng


def _set_rng_state(rng: Mapping[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    version, state, gauss = rng["python"]
    random.setstate((version, tuple(state), gauss))
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    if "numpy" in rng and "numpy" in sys.modules:
        np = sys.modules["numpy"]
        kind, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def _mp_rank(engine: DeepSpeedEngine) -> int:
    return engine.mpu.get_model_parallel_rank() if engine.mpu is not None else 0


def _partitioned_keys(module: torch.nn.Module) -> set[str]:
    """State-dict keys of ZeRO-3 partitioned parameters: their values live in the zero shards
    (see [Note: checkpoint layout and crash safety]); persistent (whole) ones stay here."""
    return {
        key
        for key, value in module.state_dict(keep_vars=True).items()
        if hasattr(value, "ds_id") and not getattr(value, "ds_persist", False)
    }


def _module_state(engine: DeepSpeedEngine, exclude_frozen: bool) -> dict[str, Any]:
    partitioned = _partitioned_keys(engine.module)
    whole = {k: v for k, v in engine.module.state_dict().items() if k not in partitioned}
    state = module_state(engine.module, whole, engine.expert_groups)
    if exclude_frozen:
        frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
        state = {k: v for k, v in state.items() if k not in frozen}
    return state


def _engine_state(engine: DeepSpeedEngine, client_state: Mapping[str, Any], exclude_frozen: bool):
    loader = engine.training_dataloader
    module = engine.module
    return {
        "module": _module_state(engine, exclude_frozen),
        "zero_shard_keys": sorted(_partitioned_keys(module)),
        # DeepSpeed's keys: what zero_to_fp32's exclude_frozen_parameters leaves out.
        "buffer_names": [n for n, _ in module.named_buffers()],
        "frozen_param_shapes": {
            n: tuple(getattr(p, "ds_shape", p.shape))
            for n, p in module.named_parameters()
            if not p.requires_grad
        },
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler else None,
        "data_loader": loader.state_dict() if loader is not None else None,
        "data_efficiency": engine.data_efficiency_state(),  # curriculum / PLD schedules
        "dp_world_size": engine.dp_world_size,
        # AutoTP: how each shard was split, to merge the zero_mp folders offline
        "tp_layout": tp_layout(module) if is_autotp_model(module) else None,
        "ds_version": __version__,
        "client_state": dict(client_state),
    }


def _write_latest(save_dir: Path, tag: str) -> None:
    temp = save_dir / f".{_LATEST}.tmp"
    with open(temp, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, save_dir / _LATEST)


@contextlib.contextmanager
def tag_directory(
    save_dir: str | os.PathLike[str], tag: str, *, rank: int, save_latest: bool
) -> Iterator[Path]:
    """The ``.<tag>.partial`` directory every rank writes into; on a clean exit rank 0 renames
    it to ``<tag>`` and then updates ``latest`` (see [Note: checkpoint layout and crash
    safety]). Every rank must enter it (it holds barriers)."""
    _check_same_tag(tag)
    root = Path(save_dir)
    partial, target = root / f".{tag}.partial", root / tag
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        repair_directory(target)  # never delete the only complete copy of a reused tag
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
    _barrier()
    yield partial
    _barrier()
    write_directory_manifest(partial)  # collective: every rank checksums a share
    if rank == 0:
        replace_dir(partial, target)
        if save_latest:
            _write_latest(root, tag)
    _barrier()


def _read_latest(latest: Path) -> str:
    """The tag in a ``latest`` file, or a :class:`CheckpointError` saying what is wrong with it."""
    raw = latest.read_bytes()
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(
            f"{str(latest)!r} is not text ({len(raw)} bytes): it should hold one checkpoint tag"
        ) from None
    if not tag or "\n" in tag or "\x00" in tag:
        raise CheckpointError(
            f"{str(latest)!r} holds {tag!r}: it should hold one checkpoint tag (empty or "
            "several lines: the file was truncated or overwritten); pass tag= to choose one"
        )
    return tag


def resolve_checkpoint(load_dir: str | os.PathLike[str], tag: str | None) -> Path | None:
    """``load_dir/tag`` (``tag`` None: the one ``latest`` names), verified against its
    ``ds_manifest.json`` (collective: every rank must call it); None when there is no ``latest``;
    an error naming the path when no complete copy of the directory exists (see [Note:
    checkpoint layout and crash safety])."""
    path = locate_checkpoint(load_dir, tag)
    if path is not None:
        verify_directory(path)
    return path


def locate_checkpoint(load_dir: str | os.PathLike[str], tag: str | None) -> Path | None:
    """:func:`resolve_checkpoint` without the verification (the caller starts it)."""
    root = Path(load_dir)
    if tag is None:
        latest = root / _LATEST
        if not latest.is_file():
            return None
        tag = _read_latest(latest)
    named = root / str(tag)
    path = recover_directory(named)
    if path is None:
        raise FileNotFoundError(
            f"checkpoint {str(named)!r} does not exist (tag {tag!r}), and no complete copy of it "
            f"is left in {named.with_name('.' + named.name + '.partial').name} or "
            f"{named.with_name('.' + named.name + '.old').name}"
        )
    _check_same_tag(str(tag))
    return path


def save_checkpoint(
    engine: DeepSpeedEngine,
    save_dir: str | os.PathLike[str],
    *,
    tag: str | None,
    client_state: Mapping[str, Any],
    save_latest: bool,
    exclude_frozen_parameters: bool,
) -> Path:
    """Save the engine to ``save_dir/tag`` (see [Note: checkpoint layout and crash safety])."""
    check_client_state(dict(client_state))
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    rank, mp = engine.global_rank, _mp_rank(engine)
    with tag_directory(save_dir, tag, rank=rank, save_latest=save_latest) as partial:
        state = _engine_state(engine, client_state, exclude_frozen_parameters)
        _write(_rng_state(), partial / _rng_file(rank))
        # one writer per replica: data-parallel (and, with Ulysses, sequence) rank 0
        if engine.seq_dp_rank == 0:
            _write(state, partial / f"mp_rank_{mp:02d}_model_states.pt")
        save_expert_files(engine.module, partial, engine.expert_groups)
        optimizer = engine.optimizer
        if isinstance(optimizer, _ZERO):
            save_sharded_checkpoint(partial / _zero_dir(engine), optimizer)
        elif optimizer is not None and engine.seq_dp_rank == 0:
            _write(optimizer.state_dict(), partial / f"mp_rank_{mp:02d}_optim_states.pt")
    if rank == 0 and isinstance(engine.optimizer, _ZERO):
        write_recovery_script(save_dir)  # as DeepSpeed copies zero_to_fp32.py there
    return Path(save_dir) / tag


def save_16bit_model(
    engine: DeepSpeedEngine,
    save_dir: str | os.PathLike[str],
    save_filename: str,
    *,
    exclude_frozen: bool,
) -> bool:
    """Write ``save_dir/save_filename`` (see ``DeepSpeedEngine.save_16bit_model``)."""
    zero = engine._config.zero_optimization
    rank = engine.global_rank
    if _partitioned_keys(engine.module) and not zero.stage3_gather_16bit_weights_on_model_save:
        engine.progress.write(
            "save_16bit_model: nothing saved; ZeRO stage 3 needs "
            "zero_optimization.stage3_gather_16bit_weights_on_model_save = true to gather the "
            "weights (or consolidate a checkpoint with ds-zero-to-fp32)"
        )
        return False
    frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
    frozen = frozen if exclude_frozen else set()
    if is_autotp_model(engine.module):  # merged over the tensor-parallel group (collective)
        merged = gather_tp_state_dict(engine.module)
        state = {k: v.cpu() for k, v in merged.items() if k not in frozen} if rank == 0 else {}
    else:  # ZeRO-3 gathered; MoE experts from every expert-parallel rank, under global ids
        state = whole_state_dict(engine.module, exclude=frozen)
    if rank == 0:
        root = Path(save_dir)
        root.mkdir(parents=True, exist_ok=True)
        temp = root / f".{save_filename}.partial"
        _write(state, temp)
        os.replace(temp, root / save_filename)
    _barrier()
    return True


def _rng_file(rank: int) -> str:
    return f"rng_state_rank{rank:05d}.pt"


def _zero_dir(engine: DeepSpeedEngine) -> str:
    return "zero" if engine.mpu is None else f"zero_mp{_mp_rank(engine):02d}"


def _load_module(
    engine: DeepSpeedEngine,
    path: Path,
    saved: dict[str, Any],
    strict: bool,
    elsewhere: set[str],
    custom_load_fn: Callable[..., Any] | None = None,
) -> None:
    """The model file's weights (through ``custom_load_fn(src=, dst=)`` when given, as in
    DeepSpeed); those of ``elsewhere`` (stage 3's partitioned ones, or the weights the saved
    fp32 masters overwrite) come from the zero shards after."""
    if custom_load_fn is not None:
        custom_load_fn(src=saved, dst=engine.module)
        return
    if not elsewhere:
        load_module_state(engine.module, path, saved, engine.expert_groups, strict)
        return
    missing, unexpected = engine.module.load_state_dict(saved, strict=False)
    # and the experts, persistent ones too: the zero shards hold them by global id
    experts = set(checkpoint_names_of(engine.module, engine.expert_groups) or ())
    missing = [k for k in missing if k not in elsewhere and k not in experts]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"checkpoint {str(path)!r} does not fit the model: missing keys {missing}, "
            f"unexpected keys {unexpected}"
        )


def _read_model_file(pending: PendingVerification, path: Path, skipped: bool) -> dict[str, Any]:
    """The model file, read while the checksums run; a reading error is noted for the verdict
    (every rank hears of it) instead of raised here. Where the check copies the file's tensors
    out as it hashes them, only the file's structure is read (mapped: no tensor's bytes), and
    :meth:`~ds_zero.PendingVerification.verified_object` gives the values after the verdict;
    otherwise the tensors are read and hashed from what was read (no second read), mapped
    where the load skips some of them (``skipped``: their bytes are then never read)."""
    try:
        state = load_file(path, mmap=skipped or pending.copying(path))
    except CheckpointError as exc:
        pending.note(str(exc))
        return {}
    pending.hash_loaded(path, state)  # nothing to do for a file copied as it is hashed
    return state


def _load_weights_from_shards(
    engine: DeepSpeedEngine, tensors: Iterator[tuple[str, torch.Tensor]]
) -> None:
    """The module's weights from a sharded checkpoint's fp32 masters (``tensors``, from
    ``iter_fp32_tensors``), one tensor at a time (a partitioned parameter is gathered, set and
    re-partitioned; every rank reads the same values, so nothing else is communicated)."""
    # ZeRO-3 shards name experts by global id (see [Note: MoE under the engine])
    names = checkpoint_names_of(engine.module, engine.expert_groups) or {}
    named = engine.module.named_parameters(remove_duplicate=False)
    params = {names.get(n, n): p for n, p in named}
    with torch.no_grad():
        for name, value in tensors:
            param = params.get(name)
            if param is None:
                continue  # a buffer: the model file held it
            with GatheredParameters([param], modifier_rank=0):
                param.data.copy_(value.view(param.shape))


def _plain_zero(
    engine: DeepSpeedEngine, custom_load_fn: Callable[..., Any] | None
) -> ZeroOptimizer | None:
    """The engine's ZeRO-1/2 optimizer where the module's weights load as its plain state dict
    (no ``custom_load_fn``, no MoE experts), else None."""
    optimizer = engine.optimizer
    if (
        not isinstance(optimizer, ZeroOptimizer)
        or optimizer.module is not engine.module
        or custom_load_fn is not None
        or engine.expert_groups is not None
    ):
        return None
    return optimizer


def _master_views(
    engine: DeepSpeedEngine, custom_load_fn: Callable[..., Any] | None
) -> dict[str, torch.Tensor]:
    """Where a ZeRO-1/2 weights-only load may copy the model file's weights as they are
    checked: the fp32 masters, by parameter name (see [Note: weights loaded into the
    masters])."""
    optimizer = _plain_zero(engine, custom_load_fn)
    return optimizer.master_views() if optimizer is not None else {}


def _overwritten_keys(
    engine: DeepSpeedEngine, custom_load_fn: Callable[..., Any] | None
) -> dict[str, torch.Size]:
    """The module's state-dict keys, with their parameters' shapes, whose model-file weights a
    full ZeRO-1/2 load would only overwrite with the saved fp32 masters (see [Note: weights
    the masters overwrite])."""
    optimizer = _plain_zero(engine, custom_load_fn)
    if optimizer is None:
        return {}
    ids = {id(p) for p in optimizer.params_from_masters()}
    state = engine.module.state_dict(keep_vars=True)
    return {key: value.shape for key, value in state.items() if id(value) in ids}


def _drop_overwritten(
    pending: PendingVerification, path: Path, state: dict[str, Any], keys: Mapping[str, Any]
) -> set[str]:
    """Drop ``keys`` (see :func:`_overwritten_keys`) from the model file's module state as read
    (neither checked nor used); return those dropped. A weight whose shape is not its
    parameter's is noted for the verdict: every rank refuses the load before anything is
    written, where the module's ``load_state_dict`` refused it after the verdict."""
    module = state.get("module")
    if not keys or not isinstance(module, dict):
        return set()
    dropped = {key for key in keys if key in module}
    for key in sorted(dropped):
        found = getattr(module.pop(key), "shape", None)
        if found != keys[key]:
            pending.note(
                f"{path}: {key!r} has shape {list(found or ())} in the checkpoint, the model's "
                f"parameter {list(keys[key])}: load it into the model it was saved from"
            )
    return dropped


@contextlib.contextmanager
def _masters_put_back_on_failure(optimizer: ZeroOptimizer | None) -> Iterator[None]:
    """If the block fails, ``optimizer``'s fp32 masters (which the load may have written before
    the verdict) are put back from the model's parameters, which nothing changed before it
    (see [Note: weights loaded into the masters]); None: nothing to put back."""
    try:
        yield
    except BaseException:
        if optimizer is not None:  # after the checksum threads stopped (the inner block)
            optimizer.refresh_fp32_params()
        raise


def _fp32_masters(
    pending: PendingVerification, zero_dir: Path
) -> Iterator[tuple[str, torch.Tensor]] | None:
    """``iter_fp32_tensors`` of ``zero_dir``, its shard files mapped and handed to the pending
    check now; None (the error noted for the verdict) when the zero folder cannot be read."""
    try:
        return iter_fp32_tensors(zero_dir, verified=pending)
    except Exception as exc:  # told to every rank at the verdict (none waits on this one)
        pending.note(str(exc) if isinstance(exc, CheckpointError) else f"{zero_dir}: {exc}")
        return None


def load_checkpoint(
    engine: DeepSpeedEngine,
    load_dir: str | os.PathLike[str],
    *,
    tag: str | None,
    strict: bool,
    optimizer_states: bool,
    lr_scheduler_states: bool,
    module_only: bool,
    custom_load_fn: Callable[..., Any] | None = None,
) -> tuple[str | None, dict[str, Any] | None]:
    """Load a checkpoint written by :func:`save_checkpoint` (weights only, never code), or one
    DeepSpeed wrote (see ``ds_engine._deepspeed_ckpt``)."""
    if engine._config.checkpoint.load_universal:  # DeepSpeed's universal folder layout
        from ds_engine.checkpoint._universal_load import load_universal_checkpoint

        return load_universal_checkpoint(
            engine,
            load_dir,
            tag=tag,
            strict=strict,
            optimizer_states=optimizer_states,
            lr_scheduler_states=lr_scheduler_states,
            module_only=module_only,
            custom_load_fn=custom_load_fn,
        )
    ds_path = deepspeed_tag_dir(load_dir, tag)
    if ds_path is not None:
        return load_deepspeed_checkpoint(
            engine,
            ds_path,
            strict=strict,
            optimizer_states=optimizer_states,
            lr_scheduler_states=lr_scheduler_states,
            module_only=module_only,
            custom_load_fn=custom_load_fn,
        )
    path = locate_checkpoint(load_dir, tag)
    if path is None:
        engine.progress.write(f"no 'latest' file in {load_dir}: nothing to load")
        return None, None
    # Checksums on threads while the files are read; nothing is written before the verdict
    # (see ds-zero's [Note: verification overlapped with reading]).
    optimizer = engine.optimizer
    from_shards = optimizer_states and isinstance(optimizer, _ZERO)
    # Without the optimizer's states only the fp32 masters of the shards are read: only those
    # bytes are checked (ds-zero's [Note: a path verifies what it uses]).
    values = None if from_shards else ("param",)
    model_file = f"mp_rank_{_mp_rank(engine):02d}_model_states.pt"
    # A ZeRO-3 model's weights, or the optimizer's states, come from the shard files: they are
    # hashed from the start (ds-zero's [Note: hashing ahead of the loader]). Without either,
    # the model file tells whether they are read at all.
    ahead = from_shards or bool(_partitioned_keys(engine.module))
    views = {} if from_shards else _master_views(engine, custom_load_fn)
    into = {model_file: {f"module/{name}": view for name, view in views.items()}}
    if from_shards and isinstance(optimizer, _ZERO):  # the pieces into the state's buffers
        folder = _zero_dir(engine)
        for file, places in optimizer.shard_destinations(path / folder).items():
            into[f"{folder}/{file}"] = places
    written = optimizer if views and isinstance(optimizer, ZeroOptimizer) else None
    overwritten = _overwritten_keys(engine, custom_load_fn) if from_shards else {}
    unused = {model_file: [f"module/{key}" for key in overwritten]}
    with (
        _masters_put_back_on_failure(written),
        start_verification(
            path, values=values, loaded=(model_file,), ahead=ahead, into=into, unused=unused
        ) as pending,
    ):
        state = _read_model_file(pending, path / model_file, skipped=bool(overwritten))
        dropped = _drop_overwritten(pending, path / model_file, state, overwritten)
        into_masters = pending.copying_into(path / model_file)
        # Stage 3 keeps partitioned weights in the zero shards only (saved, or to be loaded);
        # without the optimizer's states ZeRO-1/2 rebuild the fp32 masters from the weights
        # and read no zero file, so none is checked (ds-zero's [Note: a path verifies what it
        # uses]).
        partitioned = _partitioned_keys(engine.module) | set(state.get("zero_shard_keys", ()))
        from_masters = bool(partitioned) and not (
            from_shards and engine._config.zero_optimization.load_from_fp32_weights
        )
        if not (from_shards or from_masters):
            pending.skip(f"{_zero_dir(engine)}/")
        masters = None
        if from_masters and not from_shards:  # mapped (and hashed as mapped) before the verdict
            masters = _fp32_masters(pending, path / _zero_dir(engine))
        if not from_shards:
            pending.wait()

        def load_module() -> None:  # after the verdict
            nonlocal state
            state = pending.verified_object(path / model_file, state)
            module = state.pop("module")
            _load_module(engine, path, module, strict, partitioned | dropped, custom_load_fn)
            if from_masters:
                tensors = masters
                if tensors is None:  # after the verdict: the files are verified
                    tensors = iter_fp32_tensors(path / _zero_dir(engine), verified=True)
                _load_weights_from_shards(engine, tensors)

        if from_shards:  # read, then the verdict, then the module, then the optimizer
            load_sharded_checkpoint(
                path / _zero_dir(engine), optimizer, verified=pending, before_apply=load_module
            )
        else:
            load_module()
            if optimizer_states and optimizer is not None:
                optim_file = path / f"mp_rank_{_mp_rank(engine):02d}_optim_states.pt"
                optimizer.load_state_dict(load_file(optim_file))
            elif isinstance(optimizer, ZeroOptimizer) and into_masters:
                optimizer.refresh_fp32_params(exclude=views)  # the masters not loaded into
            elif isinstance(optimizer, _ZERO):
                optimizer.refresh_fp32_params()  # the fp32 masters from the loaded weights
    if module_only:
        return str(path), state["client_state"]
    if lr_scheduler_states and engine.lr_scheduler is not None and state["lr_scheduler"]:
        engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
    engine.global_steps = int(state["global_steps"])
    engine.global_samples = int(state["global_samples"])
    engine.micro_steps = int(state["micro_steps"])
    engine.skipped_steps = int(state["skipped_steps"])
    if engine.training_dataloader is not None and state["data_loader"] is not None:
        engine.training_dataloader.load_state_dict(state["data_loader"])
    engine.load_data_efficiency_state(state.get("data_efficiency"))
    rng_file = path / _rng_file(engine.global_rank)
    if rng_file.is_file():  # absent when loading on more ranks than saved
        _set_rng_state(load_file(rng_file))
    return str(path), state["client_state"]
