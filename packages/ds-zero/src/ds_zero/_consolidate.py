"""``consolidate`` (DeepSpeed's ``zero_to_fp32``): one fp32 state dict from a sharded checkpoint,
assembled tensor by tensor, and the ``ds-zero-to-fp32`` command.

[Note: streaming consolidation]
Shard files are mapped (``torch.load(mmap=True)``), never read whole: each tensor is assembled
from its pieces into one new fp32 tensor, which touches only the pages holding its master values
(optimizer moments in the same files stay on disk). Peak memory is therefore the output state
dict plus one tensor's pieces in the page cache, not every shard file. Tied parameters (recorded
as aliases in the manifest) share one tensor in the output, as in the model. When the checkpoint
directory is a ds-engine checkpoint (``<tag>/zero`` next to ``mp_rank_00_model_states.pt``),
the module's buffers and frozen parameters, which no optimizer holds, are taken from that file,
as DeepSpeed's script does; the file's ``frozen_param_shapes`` names the frozen ones, which
``exclude_frozen_parameters`` leaves out.

[Note: the recovery script]
Every ZeRO checkpoint folder gets a ``zero_to_fp32.py`` next to ``latest``, as DeepSpeed copies
its script there: ``_recovery_script.py`` verbatim, which imports only ``torch`` (and
``safetensors`` for ``--safe_serialization``), so a checkpoint's weights can be recovered where
ds is not installed. It reads the same layout as :func:`consolidate`; the tests run it in a
subprocess whose ``sys.path`` holds no ds package.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ds_zero._checkpoint import verify_checkpoint
from ds_zero._integrity import DIRECTORY_MANIFEST, PendingVerification, verify_directory
from ds_zero._manifest import MANIFEST, CheckpointError, ShardReader, dtype_of
from ds_zero._ranks import THIS_PROCESS

__all__ = [
    "CheckpointView",
    "RECOVERY_SCRIPT",
    "LazyFp32Tensor",
    "checkpoint_tensors",
    "consolidate",
    "iter_fp32_tensors",
    "lazy_fp32_state_dict",
    "main",
    "resolve_checkpoint_dir",
    "write_recovery_script",
]

_LATEST = "latest"
RECOVERY_SCRIPT = "zero_to_fp32.py"


def resolve_checkpoint_dir(checkpoint_dir: str | os.PathLike[str], tag: str | None = None) -> Path:
    """The directory holding ``manifest.json``: ``checkpoint_dir`` itself, or
    ``checkpoint_dir/<tag>`` (``tag`` from the ``latest`` file when None), or its ``zero/``
    (``zero_mp00/``) sub-directory as ds-engine writes it."""
    root = Path(checkpoint_dir)
    if tag is None and (root / _LATEST).is_file():
        tag = (root / _LATEST).read_text().strip()
    base = root / tag if tag else root
    parallel = sorted(p.name for p in base.glob("zero_mp*") if (p / MANIFEST).is_file())
    if not (base / MANIFEST).is_file() and len(parallel) > 1:
        raise CheckpointError(
            f"{str(base)!r} holds {len(parallel)} model-parallel ZeRO folders "
            f"({', '.join(parallel)}): a tensor-parallel (AutoTP) checkpoint, whose shards must "
            "be merged by its tp_layout, not one folder taken for the model; use "
            "deepspeed.utils.zero_to_fp32 (ds-engine), which merges them, or pass one zero_mp "
            "folder for that rank's shards"
        )
    for candidate in (base, base / "zero", *sorted(base.glob("zero_mp*"))):
        if (candidate / MANIFEST).is_file():
            return candidate
    raise CheckpointError(
        f"no {MANIFEST} in {str(base)!r} or its zero/ sub-directory: not a ds-zero sharded "
        "checkpoint (pass the directory save_sharded_checkpoint or save_checkpoint wrote, and "
        "tag= when it holds several)"
    )


def _engine_model_file(source: Path) -> Mapping[str, Any]:
    """The ds-engine model file saved next to the zero directory (mapped, not read), if any."""
    if not source.name.startswith("zero"):
        return {}
    mp = source.name.removeprefix("zero_mp") if source.name != "zero" else "00"
    path = source.parent / f"mp_rank_{mp}_model_states.pt"
    if not path.is_file():
        return {}
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    return state if isinstance(state, Mapping) else {}


def _engine_module_state(
    source: Path, exclude_frozen: bool = False
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The module tensors of the model file next to ``source``, and the names of the frozen
    parameters to leave out (none unless ``exclude_frozen``)."""
    saved = _engine_model_file(source)
    module = {k: v for k, v in saved.get("module", {}).items() if torch.is_tensor(v)}
    if exclude_frozen and module and "buffer_names" not in saved:
        raise CheckpointError(
            f"{str(source.parent)!r} does not record which of its module tensors are buffers "
            "(written before ds kept frozen_param_shapes), so frozen parameters cannot be left "
            "out; consolidate without exclude_frozen_parameters"
        )
    frozen = set(saved.get("frozen_param_shapes", {})) if exclude_frozen else set()
    return {k: v for k, v in module.items() if k not in frozen}, frozen


def _verified(source: Path) -> dict[str, Any]:
    """:func:`~ds_zero.verify_checkpoint`; inside a ds-engine tag folder (``ds_manifest.json``
    next to ``zero/``), the whole folder first, since its model file is read too."""
    if (source.parent / DIRECTORY_MANIFEST).is_file():
        verify_directory(source.parent, group=THIS_PROCESS)  # not collective: one rank may call
        return verify_checkpoint(source, files=False, group=THIS_PROCESS)
    return verify_checkpoint(source, group=THIS_PROCESS)


def checkpoint_tensors(
    source: Path,
    manifest: Mapping[str, Any],
    *,
    exclude_frozen: bool = False,
    reader: ShardReader | None = None,
) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]], Iterator[tuple[str, torch.Tensor]]]:
    """What a verified checkpoint holds, and an iterator assembling it one fp32 tensor at a time
    (see [Note: streaming consolidation]). ``reader``: the load's own (files already mapped).

    Returns:
        ``[(name, shape, saved dtype)]`` in model order (aliases left out), and an iterator of
        ``(name, fp32 tensor)`` in the same order.
    """
    extras, frozen = _engine_module_state(source, exclude_frozen)
    extras = {k: v for k, v in extras.items() if k not in manifest["tensors"]}
    extras = {k: v for k, v in extras.items() if k not in manifest.get("aliases", {})}
    names = [name for name in manifest["tensors"] if name not in frozen]
    entries = [
        (
            name,
            tuple(int(s) for s in manifest["tensors"][name]["shape"]),
            dtype_of(manifest["tensors"][name]),
        )
        for name in names
    ]
    entries += [(name, tuple(t.shape), t.dtype) for name, t in extras.items()]

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        shards = reader if reader is not None else ShardReader(source, manifest)
        try:
            for name in names:
                yield name, shards.tensor(name)
        finally:
            shards.close()
        for name, value in extras.items():
            yield name, value.float().clone() if value.is_floating_point() else value.clone()

    return entries, tensors()


def _save_atomic(obj: Any, path: Path) -> None:
    temp = path.with_name(f".{path.name}.tmp")
    with open(temp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)


def iter_fp32_tensors(
    checkpoint_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    verified: bool | PendingVerification = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, fp32 tensor)`` of a verified sharded checkpoint, one tensor at a time, in model
    order; tied aliases are left out (they name the same tensor). For loading weights into a
    model whose parameters are partitioned (ZeRO stage 3) without holding the whole model.
    The checkpoint is verified when this is called, before the first tensor is asked for.
    ``verified``: True, the caller checked the files already (against the engine folder's
    ``ds_manifest.json``): they are not checksummed again; a
    :class:`~ds_zero.PendingVerification` of the engine folder, still running: the shard files
    holding the fp32 masters are mapped now and handed to it, which hashes the masters as
    mapped (ds-zero's [Note: verifying what the loader read]), copying them out as it hashes
    where it can (the tensors are then views of that verified copy: ds-zero's [Note: copying
    while verifying]); wait for its verdict before using a tensor. Either way the zero
    manifest's seal, bindings and coverage are checked.

    Example:
        >>> for name, value in ds_zero.iter_fp32_tensors("ckpts", tag="global_step100"):
        ...     print(name, tuple(value.shape))
    """
    source = resolve_checkpoint_dir(checkpoint_dir, tag)
    if isinstance(verified, PendingVerification):
        opened: dict[str, Mapping[str, Any]] = {}  # each shard file parsed once
        manifest = verify_checkpoint(source, files=False, pending=verified, opened=opened)
        reader = ShardReader(source, manifest, opened, verified.hash_loaded, verified.verified_copy)
        read = reader.open(("param",))
        for file, stored in read.items():
            verified.hash_loaded(source / file, stored)
        verified.reads_only(source, {MANIFEST, *read})  # not the optimizer's scalars
        _, tensors = checkpoint_tensors(source, manifest, reader=reader)
        return tensors
    manifest = verify_checkpoint(source, files=False) if verified else _verified(source)
    _, tensors = checkpoint_tensors(source, manifest)
    return tensors


def consolidate(
    checkpoint_dir: str | os.PathLike[str],
    output_file: str | os.PathLike[str] | None = None,
    *,
    tag: str | None = None,
    progress: bool = True,
    exclude_frozen_parameters: bool = False,
) -> dict[str, torch.Tensor]:
    """One fp32 state dict from a sharded checkpoint of any stage and world size, for plain
    ``nn.Module.load_state_dict`` (DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``).

    The checkpoint is verified first (files, checksums, coverage), then assembled tensor by tensor
    (see [Note: streaming consolidation]).

    Args:
        checkpoint_dir: a directory from :func:`~ds_zero.save_sharded_checkpoint`, or a
            ds-engine ``save_dir`` / tag directory.
        output_file: also ``torch.save`` the state dict there (atomically).
        tag: the engine checkpoint tag (default: the ``latest`` file's).
        progress: show a tqdm progress bar.
        exclude_frozen_parameters: leave out the frozen parameters the engine's model file
            holds (its ``frozen_param_shapes``), keeping the buffers.

    Returns:
        Parameter (and, for engine checkpoints, buffer) name -> fp32 tensor.

    Example:
        >>> model.load_state_dict(ds_zero.consolidate("ckpts", tag="global_step100"))
    """
    from tqdm.auto import tqdm

    source = resolve_checkpoint_dir(checkpoint_dir, tag)
    manifest = _verified(source)
    entries, tensors = checkpoint_tensors(
        source, manifest, exclude_frozen=exclude_frozen_parameters
    )
    state: dict[str, torch.Tensor] = {}
    for name, value in tqdm(
        tensors, total=len(entries), desc="consolidating", unit="tensor", disable=not progress
    ):
        state[name] = value
    for alias, name in manifest.get("aliases", {}).items():
        if name in state:
            state[alias] = state[name]
    if output_file is not None:
        _save_atomic(state, Path(output_file))
    return state


class LazyFp32Tensor:
    """One tensor of a checkpoint, assembled only when asked (DeepSpeed's lazy ``GatheredTensor``).

    Attributes:
        shape: the tensor's shape.
        dtype: ``torch.float32`` for floating tensors (what :meth:`contiguous` returns), else the
            saved dtype.
    """

    def __init__(self, reader: ShardReader | None, name: str, shape: tuple[int, ...], value: Any):
        self._reader, self._name, self._value = reader, name, value
        self.shape = torch.Size(shape)
        saved = value.dtype if value is not None else torch.float32
        self.dtype = torch.float32 if saved.is_floating_point else saved

    def contiguous(self) -> torch.Tensor:
        """The tensor, read now (a new CPU tensor each call)."""
        if self._value is not None:
            return self._value.to(self.dtype, copy=True)
        assert self._reader is not None
        return self._reader.tensor(self._name).contiguous()

    def numel(self) -> int:
        """Elements in the tensor."""
        return self.shape.numel()

    def __repr__(self) -> str:
        return f"LazyFp32Tensor({self._name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"


def lazy_fp32_state_dict(
    checkpoint_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
) -> dict[str, LazyFp32Tensor]:
    """Name -> :class:`LazyFp32Tensor` of a verified checkpoint: nothing is read until a
    tensor's ``contiguous()`` (DeepSpeed's ``lazy_mode``). Tied names share one object.

    Example:
        >>> lazy = ds_zero.lazy_fp32_state_dict("ckpts")
        >>> lazy["tok.weight"].contiguous()
    """
    source = resolve_checkpoint_dir(checkpoint_dir, tag)
    manifest = _verified(source)
    reader = ShardReader(source, manifest)
    extras, frozen = _engine_module_state(source, exclude_frozen_parameters)
    state: dict[str, LazyFp32Tensor] = {}
    for name, entry in manifest["tensors"].items():
        if name not in frozen:
            shape = tuple(int(s) for s in entry["shape"])
            state[name] = LazyFp32Tensor(reader, name, shape, None)
    for name, value in extras.items():
        if name not in state and name not in manifest.get("aliases", {}):
            state[name] = LazyFp32Tensor(None, name, tuple(value.shape), value)
    for alias, name in manifest.get("aliases", {}).items():
        if name in state:
            state[alias] = state[name]
    return state


class CheckpointView:
    """A verified sharded checkpoint, read piece by piece: what a converter (``ds-to-universal``)
    needs without knowing the shard files' layout.

    Attributes:
        directory: the directory holding ``manifest.json``.
        shapes: each tensor's shape, in model order (tied aliases left out).
        aliases: tied name -> the name whose values it shares.
        stage: the ZeRO stage that saved it.

    Example:
        >>> view = CheckpointView("ckpts", tag="global_step100")
        >>> for start, stop in view.pieces("tok.weight"):
        ...     view.values("tok.weight", start, stop)["exp_avg"]
    """

    def __init__(self, checkpoint_dir: str | os.PathLike[str], tag: str | None = None) -> None:
        self.directory = resolve_checkpoint_dir(checkpoint_dir, tag)
        self._manifest = _verified(self.directory)
        self._reader = ShardReader(self.directory, self._manifest)
        tensors = self._manifest["tensors"]
        self.shapes = {n: tuple(int(s) for s in e["shape"]) for n, e in tensors.items()}
        self.aliases: dict[str, str] = dict(self._manifest.get("aliases", {}))
        self.stage = self._manifest.get("stage")

    def pieces(self, name: str) -> list[tuple[int, int]]:
        """The element ranges ``[start, stop)`` of ``name`` as the saving ranks held them."""
        entry = self._reader.entry(name)
        return sorted((int(a), int(b)) for _, _, a, b in entry["pieces"] if a < b)

    def values(self, name: str, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Elements ``[start, stop)`` of every saved value of ``name`` (``param`` (the fp32
        master), ``exp_avg``, ...), each a new fp32 1-D tensor."""
        return self._reader.lookup(name, start, stop)

    def scalars(self) -> dict[str, Any]:
        """What every rank shared: per param group ``{"hyper", "state"}`` (``state["step"]``),
        the loss scaler's state and the step counters."""
        path = self.directory / "scalars.pt"
        if not path.is_file():
            raise CheckpointError(f"{str(path)!r} is missing: the checkpoint is incomplete")
        return torch.load(path, map_location="cpu", weights_only=True)

    def close(self) -> None:
        """Drop the mapped shard files."""
        self._reader.close()


def write_recovery_script(directory: str | os.PathLike[str]) -> Path:
    """Write ``zero_to_fp32.py`` (see [Note: the recovery script]) into ``directory``
    atomically, executable; returns its path.

    Example:
        >>> ds_zero.write_recovery_script("ckpts")  # then: python ckpts/zero_to_fp32.py ckpts out
    """
    target = Path(directory) / RECOVERY_SCRIPT
    temp = target.with_name(f".{RECOVERY_SCRIPT}.tmp")
    shutil.copyfile(Path(__file__).with_name("_recovery_script.py"), temp)
    temp.chmod(0o755)
    os.replace(temp, target)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    """``ds-zero-to-fp32 CHECKPOINT_DIR OUTPUT [-t TAG] [--safe_serialization]
    [--max_shard_size 5GB] [--exclude_frozen_parameters]``: DeepSpeed's ``zero_to_fp32.py``
    flags. Without ``--safe_serialization`` OUTPUT is a file (one ``torch.save`` state dict)."""
    parser = argparse.ArgumentParser(
        prog="ds-zero-to-fp32",
        description="Turn a ds-zero sharded checkpoint into one fp32 state dict "
        "(DeepSpeed's zero_to_fp32.py).",
        allow_abbrev=False,
    )
    parser.add_argument("checkpoint_dir", help="the checkpoint (or engine save_dir / tag) folder")
    parser.add_argument(
        "output_file",
        help="the torch.save file to write; with --safe_serialization, the folder for "
        "model.safetensors (and its index when sharded)",
    )
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: latest)")
    parser.add_argument(
        "--safe_serialization", action="store_true", help="write safetensors files instead"
    )
    parser.add_argument(
        "--max_shard_size", default="5GB", help="largest safetensors file (default 5GB)"
    )
    parser.add_argument(
        "--exclude_frozen_parameters", action="store_true", help="leave frozen parameters out"
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.safe_serialization:
        from ds_zero._safetensors import export_safetensors

        source = resolve_checkpoint_dir(args.checkpoint_dir, args.tag)
        export_safetensors(
            source,
            args.output_file,
            max_shard_size=args.max_shard_size,
            dtype=torch.float32,
            progress=not args.quiet,
            exclude_frozen_parameters=args.exclude_frozen_parameters,
        )
    else:
        consolidate(
            args.checkpoint_dir,
            args.output_file,
            tag=args.tag,
            progress=not args.quiet,
            exclude_frozen_parameters=args.exclude_frozen_parameters,
        )
    return 0
