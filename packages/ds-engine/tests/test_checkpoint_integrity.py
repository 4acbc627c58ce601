"""End-to-end checkpoint integrity: a corruption matrix (kind x file x load path) where every
case is refused with an error naming the file (and the tensor where one is hit), on every rank,
before any value is used; and clear errors for truncated or invalid files of every kind.

The matrix runs in-process against :func:`ds_zero.verify_directory`, the check every load path
runs first (``resolve_checkpoint``), for every file of a two-rank ZeRO-2 checkpoint; the load
paths themselves (full, ``load_module_only``, ``load_optimizer_states=False``, zero-to-fp32)
are then run on two ranks against a corrupted copy.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _engine_testing import config, loss_of, make_dataset, make_mlp

TAG = "t"


def _engine(seed: int = 0):
    import ds_engine

    cfg = config(
        zero_optimization={"stage": 2},
        scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
    )
    engine, *_ = ds_engine.initialize(model=make_mlp(seed), config=cfg)
    return engine


def _save_body(rank: int, world_size: int, *, root: str) -> None:
    engine = _engine()
    data = make_dataset(32)
    for step in range(2):
        at = 8 * step + 4 * rank
        engine.backward(loss_of(engine, [t[at : at + 4] for t in data.tensors]))
        engine.step()
    engine.save_checkpoint(root, tag=TAG, client_state={"note": "saved"})


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("integrity") / "ckpt"
    run_on_ranks(_save_body, 2, root=str(root), timeout=300)
    return root


def _files(root: Path) -> list[str]:
    folder = root / TAG
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


# --- corruptions -----------------------------------------------------------------------------------


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _flip_at(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _delete(path: Path) -> None:
    path.unlink()


def _swap(path: Path) -> str:
    """Swap with the other file of the same kind (rank 0's with rank 1's), or else any other."""
    folder = path.parent
    same = sorted(p for p in folder.iterdir() if p != path and p.suffix == path.suffix)
    kin = [p for p in same if p.name.rstrip("0123456789.pt") == path.name.rstrip("0123456789.pt")]
    other = (kin or same or [p for p in folder.parent.rglob("*") if p.is_file() and p != path])[0]
    a, b = path.read_bytes(), other.read_bytes()
    path.write_bytes(b)
    other.write_bytes(a)
    return other.name


KINDS: dict[str, Callable[[Path], str | None]] = {
    "flip byte": _flip,
    "truncate": _truncate,
    "delete": _delete,
    "swap files": _swap,
}


def _refusal(root: Path) -> str:
    from ds_engine._checkpoint import resolve_checkpoint
    from ds_zero import CheckpointError

    with pytest.raises((CheckpointError, FileNotFoundError)) as info:
        resolve_checkpoint(root, TAG)
    return str(info.value)


def test_every_corruption_of_every_file_is_refused_naming_the_file(
    saved: Path, tmp_path: Path
) -> None:
    files = _files(saved)
    assert {"mp_rank_00_model_states.pt", "rng_state_rank00001.pt", "ds_manifest.json"} <= set(
        files
    )
    assert any(f.startswith("zero/zero_shards_rank") for f in files)
    table = []
    for kind, corrupt in KINDS.items():
        for file in files:
            root = tmp_path / "c"
            shutil.copytree(saved, root)
            partner = corrupt(root / TAG / file)
            message = _refusal(root)
            assert file in message or (partner and partner in message), (kind, file, message)
            table.append((kind, file, message.splitlines()[-1].strip()[:90]))
            shutil.rmtree(root)
    print("\n".join(" | ".join(row) for row in table))
    print(
        f"corruption matrix: {len(table)} cases ({len(KINDS)} kinds x {len(files)} files), "
        "every one refused naming the file"
    )


def test_a_flipped_tensor_byte_names_the_tensor(saved: Path, tmp_path: Path) -> None:
    root = tmp_path / "c"
    shutil.copytree(saved, root)
    manifest = json.loads((root / TAG / "ds_manifest.json").read_text())
    entry = manifest["files"]["mp_rank_00_model_states.pt"]["tensors"]["module/3.weight"]
    path = root / TAG / "mp_rank_00_model_states.pt"
    data = bytearray(path.read_bytes())
    data[entry["offset"] + 4] ^= 0x01
    path.write_bytes(bytes(data))
    message = _refusal(root)
    assert "mp_rank_00_model_states.pt corrupted" in message
    assert "tensor 'module/3.weight' (torch.float32 [4, 16] at byte" in message


def _edit_global_steps(folder: Path) -> None:
    path = folder / "mp_rank_00_model_states.pt"
    state = torch.load(path, weights_only=True)
    state["global_steps"] += 1000
    torch.save(state, path)


def _repoint_piece(folder: Path) -> None:
    """Point one tensor's piece at another tensor's key in the same file (the manifest sealed
    again, as a faulty writer would; the sizes here differ, the binding is checked first)."""
    from ds_zero._integrity import seal

    path = folder / "zero" / "manifest.json"
    manifest = json.loads(path.read_text())
    pieces = [(n, p) for n, e in manifest["tensors"].items() for p in e["pieces"]]
    name, piece = pieces[0]
    other = next(p for n, p in pieces if n != name and p[0] == piece[0])
    piece[1] = other[1]
    path.write_text(json.dumps(seal(manifest)))


def _swap_piece_files(folder: Path) -> None:
    from ds_zero._integrity import seal

    path = folder / "zero" / "manifest.json"
    manifest = json.loads(path.read_text())
    entry = next(e for e in manifest["tensors"].values() if len(e["pieces"]) == 2)
    entry["pieces"][0][0], entry["pieces"][1][0] = entry["pieces"][1][0], entry["pieces"][0][0]
    path.write_text(json.dumps(seal(manifest)))


def _add_file(folder: Path) -> None:
    shutil.copy(folder / "rng_state_rank00001.pt", folder / "rng_state_rank00002.pt")


EDITS = {
    "edit global_steps": (_edit_global_steps, "mp_rank_00_model_states.pt"),
    "repoint manifest piece": (_repoint_piece, "zero/manifest.json"),
    "swap pieces' files": (_swap_piece_files, "zero/manifest.json"),
    "add an unlisted rank file": (_add_file, "rng_state_rank00002.pt"),
}


@pytest.mark.parametrize("kind", list(EDITS))
def test_plausible_edits_are_refused_naming_the_file(
    saved: Path, tmp_path: Path, kind: str
) -> None:
    edit, file = EDITS[kind]
    root = tmp_path / "c"
    shutil.copytree(saved, root)
    edit(root / TAG)
    assert file in _refusal(root)


def test_a_repointed_piece_is_refused_by_the_zero_manifest_alone(
    saved: Path, tmp_path: Path
) -> None:
    """zero-to-fp32 and universal loading of a bare ds-zero folder check the bindings too."""
    from ds_zero import CheckpointError, verify_checkpoint

    root = tmp_path / "c"
    shutil.copytree(saved, root)
    _repoint_piece(root / TAG)
    with pytest.raises(CheckpointError, match="the manifest does not match the file"):
        verify_checkpoint(root / TAG / "zero")


# --- clear errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "says"),
    [(b"", "should hold one checkpoint tag"), (b"\x80\xff\x00binary", "is not text")],
)
def test_a_broken_latest_file_is_named(saved: Path, tmp_path: Path, content, says) -> None:
    from ds_engine._checkpoint import resolve_checkpoint
    from ds_zero import CheckpointError

    root = tmp_path / "c"
    shutil.copytree(saved, root)
    (root / "latest").write_bytes(content)
    with pytest.raises(CheckpointError, match=says) as info:
        resolve_checkpoint(root, None)
    assert str(root / "latest") in str(info.value)


@pytest.mark.parametrize("text", ["", '{"format": "ds.checkpoint/1", "fil', "[1, 2]", "\x00\xff"])
def test_a_broken_manifest_is_named(saved: Path, tmp_path: Path, text: str) -> None:
    root = tmp_path / "c"
    shutil.copytree(saved, root)
    (root / TAG / "ds_manifest.json").write_bytes(text.encode("latin-1"))
    message = _refusal(root)
    assert "ds_manifest.json" in message
    assert any(s in message for s in ("empty", "not valid JSON", "not an object", "UTF-8"))


def test_unreadable_checkpoint_files_are_named_by_load_file(tmp_path: Path) -> None:
    from ds_zero import CheckpointError, load_file

    path = tmp_path / "x.pt"
    torch.save({"w": torch.ones(100)}, path)
    with open(path, "r+b") as f:
        f.truncate(200)
    with pytest.raises(CheckpointError, match=r"x\.pt' \(200 bytes\) cannot be read"):
        load_file(path)


# --- every load path, on two ranks -----------------------------------------------------------------


@contextmanager
def _local_world(processes: str) -> Iterator[None]:
    """``LOCAL_WORLD_SIZE`` set to ``processes`` (the processes said to share this machine's
    cores, which decides whether a core is spare for the checksum threads) for the block only:
    the harness reuses its rank processes."""
    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = processes
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("LOCAL_WORLD_SIZE", None)
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved


def _load_paths_body(rank: int, world_size: int, *, root: str, local_world: str) -> list[str]:
    """Each load path on a checkpoint whose rank-1 rng file and model file are corrupted: every
    rank raises the same error (none hangs), naming the file, before any value is used.
    ``local_world``: the processes said to share this machine's cores, which decides whether
    the model file is hashed beside the read (a core to spare) or from what was read (none)."""
    from ds_zero import CheckpointError

    engine = _engine(seed=5)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    messages = []
    with _local_world(local_world):
        for kwargs in (
            {},
            {"load_module_only": True},
            {"load_optimizer_states": False},
            {"load_optimizer_states": False, "load_lr_scheduler_states": False},
        ):
            try:
                engine.load_checkpoint(root, tag=TAG, **kwargs)
            except CheckpointError as exc:
                messages.append(str(exc))
            else:
                raise AssertionError(f"load_checkpoint(**{kwargs}) loaded a corrupted checkpoint")
            for n, p in engine.module.named_parameters():
                assert torch.equal(p, before[n]), f"{n} changed before the check refused"
            assert engine.global_steps == 0
    return messages


# "1": each rank has the machine's cores to itself (a core to spare on any machine of 2 or
# more); "1024": no rank has a core to spare.
@pytest.mark.parametrize("local_world", ["1", "1024"], ids=["core-to-spare", "no-core-to-spare"])
def test_every_load_path_refuses_on_every_rank(
    saved: Path, tmp_path: Path, local_world: str
) -> None:
    root = tmp_path / "c"
    shutil.copytree(saved, root)
    _flip(root / TAG / "rng_state_rank00001.pt")
    _flip_model_pickle(root / TAG)  # every load path reads the pickle (the counters, buffers)
    results = run_on_ranks(
        _load_paths_body, 2, root=str(root), local_world=local_world, timeout=300
    )
    assert results[0] == results[1]  # the same verdict on every rank
    for message in results[0]:
        assert "rng_state_rank00001.pt corrupted" in message
        assert "mp_rank_00_model_states.pt corrupted" in message


def _model_file_record(directory: Path) -> dict:
    manifest = json.loads((directory / "ds_manifest.json").read_text())
    return manifest["files"]["mp_rank_00_model_states.pt"]


def _flip_model_pickle(directory: Path) -> None:
    """Flip a byte of the model file's pickle (its first span outside the tensors)."""
    from ds_zero._read_checks import gap_spans

    record = _model_file_record(directory)
    start, length = gap_spans(record["tensors"], record["bytes"])[0]
    _flip_at(directory / "mp_rank_00_model_states.pt", start + length // 2)


def _overwritten_weight_body(rank: int, world_size: int, *, root: str, clean: str) -> list[str]:
    """A full and a weights-only load of ``root``, on no spare core (the model file is hashed
    from what the loader read: only what the load uses): "loaded" (the weights then those a
    load of ``clean`` gives) or the error."""
    from ds_zero import CheckpointError

    engine = _engine(seed=5)
    engine.load_checkpoint(clean, tag=TAG)
    expected = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    masters = [m.detach().clone() for m in engine.optimizer.masters]
    fresh = _engine(seed=7)
    before = {n: p.detach().clone() for n, p in fresh.module.named_parameters()}
    results = []
    with _local_world("1024"):
        for kwargs in ({}, {"load_optimizer_states": False}):
            try:
                fresh.load_checkpoint(root, tag=TAG, **kwargs)
            except CheckpointError as exc:
                results.append(str(exc))
                for n, p in fresh.module.named_parameters():
                    assert torch.equal(p, before[n]), n
                continue
            results.append("loaded")
            for n, p in fresh.module.named_parameters():
                assert torch.equal(p, expected[n]), n
            assert all(torch.equal(a, b) for a, b in zip(fresh.optimizer.masters, masters))
            before = expected  # what a refused load after this one must leave
    return results


def test_a_full_load_neither_checks_nor_uses_the_weights_the_masters_overwrite(
    saved: Path, tmp_path: Path
) -> None:
    """A full ZeRO-2 load sets the trainable weights from the saved fp32 masters: a flipped
    byte of the model file's copy of one is not its error, and it loads the saved values; the
    weights-only load, which reads that copy, refuses it naming the tensor (ds-engine's [Note:
    weights the masters overwrite])."""
    root = tmp_path / "c"
    shutil.copytree(saved, root)
    entries = _model_file_record(root / TAG)["tensors"]
    weight = next(n for n in entries if n.startswith("module/") and n.endswith(".weight"))
    _flip_at(root / TAG / "mp_rank_00_model_states.pt", entries[weight]["offset"] + 2)
    results = run_on_ranks(
        _overwritten_weight_body, 2, root=str(root), clean=str(saved), timeout=300
    )
    assert results[0] == results[1]
    full, weights_only = results[0]
    assert full == "loaded", full
    assert "mp_rank_00_model_states.pt corrupted" in weights_only, weights_only
    assert repr(weight) in weights_only, weights_only


def _zero_shard_body(rank: int, world_size: int, *, root: str) -> str:
    """A full load (the optimizer's ranges are read while the checksums run, see ds-zero's
    [Note: verification overlapped with reading]) of a checkpoint with one corrupted zero shard:
    every rank refuses, and nothing (weights, fp32 masters, optimizer state, counters) changed."""
    from ds_zero import CheckpointError

    engine = _engine(seed=5)
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    masters = [m.detach().clone() for m in engine.optimizer.masters]
    inner = engine.optimizer.optimizer
    state = {id(k): {n: torch.clone(x) for n, x in v.items()} for k, v in inner.state.items()}
    try:
        engine.load_checkpoint(root, tag=TAG)
    except CheckpointError as exc:
        message = str(exc)
    else:
        raise AssertionError("a corrupted zero shard was loaded")
    for n, p in engine.module.named_parameters():
        assert torch.equal(p, params[n]), f"{n} changed before the check refused"
    for old, new in zip(masters, engine.optimizer.masters):
        assert torch.equal(old, new), "an fp32 master changed before the check refused"
    assert set(state) == {id(k) for k in inner.state}
    for k, v in inner.state.items():
        for n, x in v.items():
            assert torch.equal(torch.as_tensor(x), torch.as_tensor(state[id(k)][n])), n
    assert engine.global_steps == 0
    return message


def test_a_corrupted_zero_shard_is_refused_before_anything_is_written(
    saved: Path, tmp_path: Path
) -> None:
    root = tmp_path / "c"
    shutil.copytree(saved, root)
    _flip(root / TAG / "zero" / "zero_shards_rank00001.pt")
    results = run_on_ranks(_zero_shard_body, 2, root=str(root), timeout=300)
    assert results[0] == results[1]  # the same verdict on every rank
    assert "zero/zero_shards_rank00001.pt corrupted" in results[0], results[0]


def test_zero_to_fp32_refuses_a_corrupted_engine_checkpoint(saved: Path, tmp_path: Path) -> None:
    from ds_zero import CheckpointError, consolidate

    root = tmp_path / "c"
    shutil.copytree(saved, root)
    _flip(root / TAG / "mp_rank_00_model_states.pt")  # its buffers are read by zero_to_fp32
    with pytest.raises(CheckpointError, match=r"mp_rank_00_model_states\.pt corrupted"):
        consolidate(root, tag=TAG, progress=False)
    shutil.rmtree(root)
    shutil.copytree(saved, root)
    assert set(consolidate(root, tag=TAG, progress=False)) == {
        n for n, _ in make_mlp().named_parameters()
    }


@pytest.mark.parametrize("file", ["zero/zero_shards_rank00000.pt", "mp_rank_00_model_states.pt"])
def test_ds_to_universal_refuses_a_corrupted_checkpoint(
    saved: Path, tmp_path: Path, file: str
) -> None:
    """The universal conversion reads a ds checkpoint through the verified view only."""
    from ds_engine.checkpoint.ds_to_universal import convert_to_universal
    from ds_zero import CheckpointError

    root = tmp_path / "c"
    shutil.copytree(saved, root)
    _flip(root / TAG / file)
    with pytest.raises(CheckpointError, match=rf"{file} corrupted"):
        convert_to_universal(root / TAG, tmp_path / "universal", inject_missing_state=True)


# --- a path verifies what it uses ------------------------------------------------------------------


def _rechunk(folder: Path, chunk: int) -> None:
    """Record the directory manifest's file checksums in ``chunk``-byte chunks (resealed), so a
    small test checkpoint has chunks that hold nothing but optimizer state."""
    import zlib

    path = folder / "ds_manifest.json"
    manifest = json.loads(path.read_text())
    for name, record in manifest["files"].items():
        data = (folder / name).read_bytes()
        record["crc32"] = [zlib.crc32(data[at : at + chunk]) for at in range(0, len(data), chunk)]
    manifest["chunk"] = chunk
    body = {k: v for k, v in manifest.items() if k != "manifest_crc32"}
    manifest["manifest_crc32"] = zlib.crc32(
        json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    )
    path.write_text(json.dumps(manifest))


def _optimizer_bytes_body(rank: int, world_size: int, *, root: str) -> str:
    """A weights-only load reads no optimizer state, so corruption there is not its concern; a
    full load reads it and refuses on every rank."""
    from ds_zero import CheckpointError

    engine = _engine(seed=5)
    engine.load_checkpoint(root, tag=TAG, load_optimizer_states=False)
    assert engine.global_steps == 2
    try:
        engine.load_checkpoint(root, tag=TAG)
    except CheckpointError as exc:
        return str(exc)
    raise AssertionError("a full load accepted corrupted optimizer state")


def test_optimizer_state_corruption_fails_a_full_load_only(saved: Path, tmp_path: Path) -> None:
    root = tmp_path / "c"
    shutil.copytree(saved, root)
    chunk = 256
    _rechunk(root / TAG, chunk)
    name = "zero/zero_shards_rank00001.pt"
    record = json.loads((root / TAG / "ds_manifest.json").read_text())["files"][name]
    entries = record["tensors"]
    first = min(e["offset"] for e in entries.values())
    last = max(e["offset"] + e["nbytes"] for e in entries.values())
    # an exp_avg byte in a chunk that holds neither the file's non-tensor bytes nor a master
    target = next(
        (n, e["offset"] + e["nbytes"] // 2)
        for n, e in entries.items()
        if n.endswith("/exp_avg")
        and (e["offset"] + e["nbytes"] // 2) // chunk > first // chunk
        and (e["offset"] + e["nbytes"] // 2) // chunk < last // chunk
    )
    data = bytearray((root / TAG / name).read_bytes())
    data[target[1]] ^= 0x10
    (root / TAG / name).write_bytes(bytes(data))
    results = run_on_ranks(_optimizer_bytes_body, 2, root=str(root), timeout=300)
    assert results[0] == results[1]
    assert f"{name} corrupted" in results[0] and repr(target[0]) in results[0], results[0]


# --- the loader's own reads (ds-zero's [Note: verifying what the loader read]) ---------------------


def _stage3_engine(seed: int = 0):
    import ds_engine

    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}  # every weight partitioned
    engine, *_ = ds_engine.initialize(model=make_mlp(seed), config=config(zero_optimization=zero))
    return engine


def _stage3_save_body(rank: int, world_size: int, *, root: str) -> None:
    engine = _stage3_engine()
    data = make_dataset(8)
    engine.backward(loss_of(engine, [t[4 * rank : 4 * rank + 4] for t in data.tensors]))
    engine.step()
    engine.save_checkpoint(root, tag=TAG)


def _stage3_load_body(rank: int, world_size: int, *, root: str) -> list[str]:
    """A full and a weights-only load of a ZeRO-3 checkpoint: the error of each (every rank the
    same), or "loaded"; a refused load changed nothing."""
    from ds_zero import CheckpointError, GatheredParameters

    engine = _stage3_engine(seed=5)
    params = list(engine.module.parameters())
    with GatheredParameters(params):
        before = [p.detach().clone() for p in params]
    results = []
    for kwargs in ({}, {"load_optimizer_states": False}):
        try:
            engine.load_checkpoint(root, tag=TAG, **kwargs)
        except CheckpointError as exc:
            with GatheredParameters(params):
                assert all(torch.equal(p, b) for p, b in zip(params, before)), kwargs
            assert engine.global_steps == 0
            results.append(str(exc))
        else:
            results.append("loaded")
    return results


def _saved_stage3(factory: pytest.TempPathFactory, ranks: int) -> Path:
    root = factory.mktemp(f"integrity3-{ranks}") / "ckpt"
    run_on_ranks(_stage3_save_body, ranks, root=str(root), timeout=300)
    return root


@pytest.fixture(scope="module")
def saved_stage3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _saved_stage3(tmp_path_factory, 2)


def test_the_loaders_reads_are_checked_as_read(saved_stage3: Path, tmp_path: Path) -> None:
    """ZeRO-3 shard files are checked from the loader's own mapped tensors and the bytes
    between them (``gaps_crc32``): a flipped fp32 master is refused by both loads, naming the
    tensor; a flipped byte of the pickle or zip headers by both; a flipped Adam moment only by
    the full load, which reads it."""
    from ds_zero._read_checks import gap_spans

    name = "zero/zero_shards_rank00001.pt"
    record = json.loads((saved_stage3 / TAG / "ds_manifest.json").read_text())["files"][name]
    assert "gaps_crc32" in record
    entries = record["tensors"]
    master = next(n for n in entries if n.endswith("/param"))
    moment = next(n for n in entries if n.endswith("/exp_avg"))
    gap = gap_spans(entries, record["bytes"])[-1]  # the zip directory
    refused = [f"{name} corrupted"]
    cases = {  # the flipped byte, and what the full and the weights-only load say
        "master": (entries[master]["offset"] + 1, [[*refused, repr(master)]] * 2),
        "gap": (gap[0] + gap[1] // 2, [refused, refused]),
        "moment": (entries[moment]["offset"] + 1, [[*refused, repr(moment)], ["loaded"]]),
    }
    for kind, (offset, expected) in cases.items():
        root = tmp_path / kind
        shutil.copytree(saved_stage3, root)
        _flip_at(root / TAG / name, offset)
        results = run_on_ranks(_stage3_load_body, 2, root=str(root), timeout=300)
        assert results[0] == results[1], kind  # the same verdict on every rank
        for got, wanted in zip(results[0], expected):
            assert all(w in got for w in wanted), (kind, got)


def test_the_optimizers_scalars_are_checked_by_the_full_load_only(
    saved_stage3: Path, tmp_path: Path
) -> None:
    """A ZeRO-3 weights-only load reads the zero manifest and the fp32 masters, not the
    optimizer's scalars: a flipped byte of ``zero/scalars.pt`` is refused by the full load,
    which reads it, and not by the weights-only load, which loads unchanged values (ds-zero's
    [Note: a path verifies what it uses])."""
    name = "zero/scalars.pt"
    root = tmp_path / "c"
    shutil.copytree(saved_stage3, root)
    _flip(root / TAG / name)
    results = run_on_ranks(_stage3_load_body, 2, root=str(root), timeout=300)
    assert results[0] == results[1]  # the same verdict on every rank
    full, weights_only = results[0]
    assert f"{name} corrupted" in full, full
    assert weights_only == "loaded", weights_only


# --- hashing ahead of the loader (ds-zero's [Note: hashing ahead of the loader]) -----------------


def _hash_ahead_load_body(
    rank: int,
    world_size: int,
    *,
    root: str,
    spare: bool,
    cached: bool = True,
    replace: str | None = None,
) -> list[str]:
    """:func:`_stage3_load_body` with the spare core and the page cache's answer forced (shard
    files hashed from the disk, or from the loader's tensors). ``replace``: once the shard file
    is hashed, and before the verdict, it is replaced by this file. A shard file's gaps are
    never left for the verdict: a thread hashes them once it is mapped."""
    from ds_zero import _integrity, _read_checks

    defer = _read_checks.HelpedPool.defer
    deferred: list[str] = []

    def recording_defer(self, fn, *args):
        deferred.append(Path(getattr(getattr(fn, "__self__", None), "path", "")).name)
        return defer(self, fn, *args)

    wait = _integrity.PendingVerification.wait
    spare_core, in_page_cache = _integrity.spare_core, _integrity.in_page_cache
    hashed_ahead: list[bool] = []
    in_place: list[bool] = []  # hashed from the loader's mapped tensors (handed over, not mapped)
    name = "zero/zero_shards_rank00000.pt"

    def replacing_wait(self, problems=(), **kwargs):
        if self._verdict is None:
            hashed_ahead.append(name in self._mapped)
            in_place.append(name in self._loaded and name not in self._mapped)
            if replace is not None:
                for _, jobs, _, gaps in self._loaded.values():
                    for job in (*jobs, gaps):
                        self._result(job)  # hashed: what follows happens after
                os.replace(replace, Path(root) / TAG / name)
                shutil.copy(Path(root).parent / "spare_copy.pt", replace)  # for the next load
        return wait(self, problems, **kwargs)

    _integrity.spare_core = lambda: spare
    _integrity.in_page_cache = lambda path, offsets: cached
    _integrity.PendingVerification.wait = replacing_wait
    _read_checks.HelpedPool.defer = recording_defer
    try:
        results = _stage3_load_body(rank, world_size, root=root)
    finally:
        _integrity.spare_core, _integrity.in_page_cache = spare_core, in_page_cache
        _integrity.PendingVerification.wait = wait
        _read_checks.HelpedPool.defer = defer
    # From a cold disk the full load's shard file (the first verdict) is copied ahead, into the
    # optimizer's buffers, and the weights-only load's once the loader has mapped it: never
    # hashed in place where it was handed over (ds-zero's [Note: hashing ahead of the loader]);
    # a verdict that comes before the loader hands it over (a refusal) finds it in neither.
    copying = spare and (cached or _integrity.COPY_KERNEL)
    assert hashed_ahead and hashed_ahead[0] == copying, hashed_ahead
    if cached or not spare:  # every verdict's shard file hashed the same way
        assert set(hashed_ahead) == {spare and cached}, hashed_ahead
    else:
        assert not any(in_place) if copying else any(in_place), (hashed_ahead, in_place)
    assert Path(name).name not in deferred, deferred
    return results


@pytest.fixture(scope="module")
def saved_stage3_one_rank(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _saved_stage3(tmp_path_factory, 1)


@pytest.mark.parametrize(
    ("spare", "cached"),
    [(True, True), (True, False), (False, True)],
    ids=[
        "hashed ahead",
        "cold: copied from the file as hashed",
        "no core to spare: hashed as read",
    ],
)
def test_a_shard_hashed_ahead_is_checked_as_one_hashed_as_read(
    saved_stage3_one_rank: Path, tmp_path: Path, spare: bool, cached: bool
) -> None:
    """Hashed from the disk before the loader maps it (a core to spare, the file in the page
    cache), a shard file is refused for the same bytes, with the same error, as when hashed
    from the loader's tensors."""
    from ds_zero._read_checks import gap_spans

    name = "zero/zero_shards_rank00000.pt"
    manifest = json.loads((saved_stage3_one_rank / TAG / "ds_manifest.json").read_text())
    entries = manifest["files"][name]["tensors"]
    master = max((n for n in entries if n.endswith("/param")), key=lambda n: entries[n]["offset"])
    moment = next(n for n in entries if n.endswith("/exp_avg_sq"))
    gap = gap_spans(entries, manifest["files"][name]["bytes"])[0]  # the pickle
    refused = f"{name} corrupted"

    def flip(offset: int) -> Callable[[Path], None]:
        return lambda path: _flip_at(path, offset)

    cases: dict[str, tuple[Callable[[Path], object], list[list[str]]]] = {
        "master": (flip(entries[master]["offset"] + 5), [[refused, repr(master)]] * 2),
        "gap": (flip(gap[0] + gap[1] // 2), [[refused]] * 2),
        "moment": (flip(entries[moment]["offset"] + 1), [[refused, repr(moment)], ["loaded"]]),
        "truncated": (_truncate, [[f"{name} truncated"]] * 2),
        "none": (lambda path: None, [["loaded"]] * 2),
    }
    for kind, (damage, expected) in cases.items():
        root = tmp_path / kind
        shutil.copytree(saved_stage3_one_rank, root)
        damage(root / TAG / name)
        (result,) = run_on_ranks(
            _hash_ahead_load_body, 1, root=str(root), spare=spare, cached=cached, timeout=300
        )
        for got, wanted in zip(result, expected):
            assert all(w in got for w in wanted), (kind, got)


@pytest.mark.parametrize("damaged", [True, False], ids=["damaged", "intact"])
def test_a_shard_replaced_after_it_was_hashed_is_checked_again(
    saved_stage3_one_rank: Path, tmp_path: Path, damaged: bool
) -> None:
    """A shard file replaced between its hashing and the verdict is not passed on the old
    file's checksums: a damaged replacement is refused, an intact one loads."""
    name = "zero/zero_shards_rank00000.pt"
    root = tmp_path / "ckpt"
    shutil.copytree(saved_stage3_one_rank, root)
    replacement = tmp_path / "replacement.pt"
    shutil.copy(root / TAG / name, replacement)
    if damaged:
        entries = json.loads((root / TAG / "ds_manifest.json").read_text())["files"][name]
        master = next(n for n in entries["tensors"] if n.endswith("/param"))
        _flip_at(replacement, entries["tensors"][master]["offset"] + 3)
    shutil.copy(replacement, tmp_path / "spare_copy.pt")
    (result,) = run_on_ranks(
        _hash_ahead_load_body,
        1,
        root=str(root),
        spare=True,
        replace=str(replacement),
        timeout=300,
    )
    if damaged:
        assert all(f"{name} corrupted" in got for got in result), result
    else:
        assert result == ["loaded", "loaded"]


# --- the model file hashed from the disk; small files on the disk read on a thread ----------------


@contextmanager
def _recording_hashes(record: Callable[[str, bool], None]) -> Iterator[None]:
    """``record(name, on_loading_thread)`` for each file a pending verification hashes apart:
    on the checksum threads (``_submit``), or, a small one, on the loading thread."""
    from ds_zero import _integrity

    pending = _integrity.PendingVerification
    submit, small = pending._submit, _integrity.small_file_problem

    def recording_submit(self, name, entry):
        record(name, False)
        return submit(self, name, entry)

    def recording_small(directory, name, entry, chunk):
        record(name, True)
        return small(directory, name, entry, chunk)

    pending._submit, _integrity.small_file_problem = recording_submit, recording_small
    try:
        yield
    finally:
        pending._submit, _integrity.small_file_problem = submit, small


def _model_file_body(rank: int, world_size: int, *, root: str, small: str) -> list:
    """A weights-only ZeRO-2 load (it reads the model file, and no zero file) with a core to
    spare, the verification's choices recorded: the result, where each small file was hashed
    (True: on the loading thread), the files mapped, and the files whose hashing was left for
    the verdict. ``small``: the small files are said to be ``"on disk"`` (they go to the
    checksum threads) or ``"cached"``, the model file being big, or every file counts as big
    (``"none"``). The model file, which the loader reads whole, is mapped and hashed from the
    disk at once."""
    from ds_zero import CheckpointError, _integrity, _read_checks

    pending = _integrity.PendingVerification
    wait, defer = pending.wait, _read_checks.HelpedPool.defer
    budget, on_disk, spare_core = _integrity._HASH_HERE, _integrity.on_disk, _integrity.spare_core
    run_here: list[bool] = []
    mapped: list[list[str]] = []
    deferred: list[str] = []

    def recording_wait(self, problems=(), **kwargs):
        if self._verdict is None:
            mapped.append(sorted(self._mapped))
        return wait(self, problems, **kwargs)

    def recording_defer(self, fn, *args):
        deferred.append(Path(getattr(getattr(fn, "__self__", None), "path", "")).name)
        return defer(self, fn, *args)

    pending.wait = recording_wait
    _read_checks.HelpedPool.defer = recording_defer
    _integrity.spare_core = lambda: True
    if small == "none":
        _integrity._HASH_HERE = 0
    else:  # the files smaller than the model file are small, and it is not
        _integrity._HASH_HERE = (Path(root) / TAG / "mp_rank_00_model_states.pt").stat().st_size - 1
        _integrity.on_disk = lambda path: small == "on disk"
    try:
        engine = _engine(seed=5)
        before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        try:
            with _recording_hashes(lambda name, here: run_here.append(here)):
                engine.load_checkpoint(root, tag=TAG, load_optimizer_states=False)
            result = "loaded"
        except CheckpointError as exc:
            result = str(exc)
            for n, p in engine.module.named_parameters():
                assert torch.equal(p, before[n]), f"{n} changed before the check refused"
    finally:
        pending.wait, _read_checks.HelpedPool.defer = wait, defer
        _integrity._HASH_HERE, _integrity.on_disk = budget, on_disk
        _integrity.spare_core = spare_core
    return [result, run_here, mapped, deferred]


@pytest.fixture(scope="module")
def saved_one_rank(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("integrity1") / "ckpt"
    run_on_ranks(_save_body, 1, root=str(root), timeout=300)
    return root


def test_a_model_file_hashed_from_the_disk_is_checked_as_one_hashed_as_read(
    saved_one_rank: Path, tmp_path: Path
) -> None:
    """The model file, which the loader reads whole and in order, is mapped and hashed from the
    disk as the check starts, cold or warm (ds-zero's [Note: hashing ahead of the loader]):
    a flipped tensor byte is refused naming the file and the tensor, a flipped byte between
    the tensors naming the file, a truncated file as truncated; an intact one loads."""
    from ds_zero._read_checks import gap_spans

    name = "mp_rank_00_model_states.pt"
    manifest = json.loads((saved_one_rank / TAG / "ds_manifest.json").read_text())
    entries = manifest["files"][name]["tensors"]
    tensor = max(entries, key=lambda n: entries[n]["nbytes"])
    gap = gap_spans(entries, manifest["files"][name]["bytes"])[0]  # the pickle
    cases: dict[str, tuple[Callable[[Path], object], list[str]]] = {
        "tensor": (
            lambda p: _flip_at(p, entries[tensor]["offset"] + 3),
            [f"{name} corrupted", repr(tensor)],
        ),
        "gap": (lambda p: _flip_at(p, gap[0] + gap[1] // 2), [f"{name} corrupted"]),
        "truncated": (_truncate, [f"{name} truncated"]),
        "none": (lambda p: None, ["loaded"]),
    }
    for kind, (damage, expected) in cases.items():
        root = tmp_path / kind
        shutil.copytree(saved_one_rank, root)
        damage(root / TAG / name)
        ((result, _, mapped, _),) = run_on_ranks(
            _model_file_body, 1, root=str(root), small="none", timeout=300
        )
        assert all(w in result for w in expected), (kind, result)
        assert mapped == [[name]], (kind, mapped)  # hashed from the disk, not as read


@pytest.mark.parametrize("small", ["cached", "on disk"])
def test_a_model_files_gaps_wait_for_the_verdict_only_from_a_cold_disk(
    saved_one_rank: Path, tmp_path: Path, small: str
) -> None:
    """The bytes between the model file's tensors are hashed on a checksum thread when the
    checkpoint's small files are in the page cache (the file's pages are too), and at the
    verdict, once the loader has read them, when they are on the disk (ds-zero's
    [Note: hashing ahead of the loader]); either way a flipped byte there is refused."""
    from ds_zero._read_checks import gap_spans

    name = "mp_rank_00_model_states.pt"
    record = json.loads((saved_one_rank / TAG / "ds_manifest.json").read_text())["files"][name]
    gap = gap_spans(record["tensors"], record["bytes"])[0]  # the pickle
    for damaged in (False, True):
        root = tmp_path / f"{damaged}"
        shutil.copytree(saved_one_rank, root)
        if damaged:
            _flip_at(root / TAG / name, gap[0] + gap[1] // 2)
        ((result, _, mapped, deferred),) = run_on_ranks(
            _model_file_body, 1, root=str(root), small=small, timeout=300
        )
        assert (f"{name} corrupted" in result) if damaged else result == "loaded", result
        assert mapped == [[name]], mapped
        assert (name in deferred) == (small == "on disk"), deferred


def _hashed_files_body(rank: int, world_size: int, *, root: str) -> list[str]:
    """The files a weights-only ZeRO-2 load hashes apart (on the checksum threads, or small
    ones on the loading thread), in the page cache."""
    hashed: list[str] = []
    engine = _engine(seed=5)
    with _recording_hashes(lambda name, _: hashed.append(name)):
        engine.load_checkpoint(root, tag=TAG, load_optimizer_states=False)
        engine.load_checkpoint(root, tag=TAG, load_optimizer_states=False)  # warm, recorded
        hashed.clear()
        engine.load_checkpoint(root, tag=TAG, load_optimizer_states=False)
    return hashed


def test_a_weights_only_zero2_load_hashes_no_zero_file(saved_one_rank: Path) -> None:
    """Without the optimizer's states ZeRO-1/2 read no file of the zero folder, so none is
    hashed, not even the small ones hashed on the loading thread (they wait for the verdict,
    by which time the load has said it skips them; ds-zero's [Note: a path verifies what it
    uses]); the other small files are."""
    (hashed,) = run_on_ranks(_hashed_files_body, 1, root=str(saved_one_rank), timeout=300)
    assert "rng_state_rank00000.pt" in hashed, hashed
    assert not [name for name in hashed if name.startswith("zero/")], hashed


def test_small_files_on_the_disk_are_read_on_a_checksum_thread(
    saved_one_rank: Path, tmp_path: Path
) -> None:
    """Small files said to be on the disk are hashed on the checksum threads (the loading
    thread would wait for the disk), and are checked all the same."""
    root = tmp_path / "c"
    shutil.copytree(saved_one_rank, root)
    _flip(root / TAG / "rng_state_rank00000.pt")
    ((result, run_here, _, _),) = run_on_ranks(
        _model_file_body, 1, root=str(root), small="on disk", timeout=300
    )
    assert "rng_state_rank00000.pt corrupted" in result, result
    assert run_here and not any(run_here), run_here


class _Transposed(torch.nn.Module):
    """:func:`make_mlp`'s parameters, in number and order, with the first weight transposed."""

    def __init__(self, mlp: torch.nn.Module) -> None:
        super().__init__()
        shapes = {n: p.shape for n, p in mlp.named_parameters()}
        first = next(iter(shapes))
        shapes[first] = torch.Size(reversed(shapes[first]))
        for name, shape in shapes.items():
            layer, attr = name.split(".")
            if not hasattr(self, layer):
                self.add_module(layer, torch.nn.Module())
            getattr(self, layer).register_parameter(attr, torch.nn.Parameter(torch.zeros(shape)))


def _transposed_load_body(rank: int, world_size: int, *, root: str) -> str:
    import ds_engine
    from ds_zero import CheckpointError

    model = _Transposed(make_mlp())
    engine, *_ = ds_engine.initialize(model=model, config=config(zero_optimization={"stage": 2}))
    try:
        engine.load_checkpoint(root, tag=TAG)
    except CheckpointError as exc:
        assert all(not p.any() for p in model.parameters())  # nothing written
        return str(exc)
    return "loaded"


def test_a_weight_the_masters_overwrite_must_still_have_its_parameters_shape(saved: Path) -> None:
    """The full load takes the trainable weights from the masters, and does not read the model
    file's copies, but a copy whose shape is not its parameter's (the masters' elements fit
    alike: the same count) is refused at the verdict, by every rank, naming the file, the
    weight and both shapes."""
    results = run_on_ranks(_transposed_load_body, 2, root=str(saved), timeout=300)
    assert results[0] == results[1]
    shapes = {n: list(p.shape) for n, p in make_mlp().named_parameters()}
    first, shape = next(iter(shapes.items()))
    expected = f"{first!r} has shape {shape} in the checkpoint, the model's parameter"
    assert "mp_rank_00_model_states.pt" in results[0] and expected in results[0], results[0]
