"""A full load whose shard files are copied as they are hashed reads its values from the copies,
after the verdict ([Note: reading the copies after the verdict] in ``_checkpoint.py``): the same
values as a plain load, and a reading failure after the verdict on one rank is every rank's
error, whichever ranks read before the verdict and which after."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ds_native
from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _ds_zero_testing import adam, global_batches, make_model, micro_batches

needs_copies = pytest.mark.skipif(
    not ds_native.native_available(), reason="no C extension: nothing is copied"
)


def _zero(model: torch.nn.Module, stage: int):
    from ds_zero import Stage3Optimizer, ZeroConfig, ZeroOptimizer

    config = ZeroConfig.from_dict({"stage": stage, "reduce_bucket_size": 4000})
    kind = Stage3Optimizer if stage == 3 else ZeroOptimizer
    return kind(model, adam(list(model.parameters())), config)


def _save(rank: int, world_size: int, *, root: str, stage: int) -> None:
    from ds_zero import save_sharded_checkpoint
    from ds_zero._integrity import write_directory_manifest

    zero = _zero(make_model(torch.float32), stage)
    for batch in global_batches(2, 8):
        (micro,) = micro_batches(batch, rank, world_size, 1)
        zero.backward(zero.module(micro))
        zero.step()
    save_sharded_checkpoint(Path(root) / "zero", zero)
    write_directory_manifest(Path(root))


def _state(zero) -> list[torch.Tensor]:
    """This rank's masters and elementwise optimizer state, in a fixed order."""
    out = []
    for master in zero.masters:
        out.append(master.detach().clone())
        state = zero.optimizer.state.get(master, {})
        out += [state[k].clone() for k in sorted(state) if state[k].dim() == 1]
    return out


@contextlib.contextmanager
def _hashed_ahead(spare: bool, cached: bool = True) -> Iterator[list[bool]]:
    """Force a core to spare (``spare``) and the files in the page cache or not (``cached``);
    record, per lookup of a range one piece holds, whether it was a view of a verified copy.
    Undone on exit: the harness reuses its rank processes."""
    from ds_zero import _integrity, _manifest

    saved = (_integrity.spare_core, _integrity.in_page_cache, _manifest.ShardReader._copy)
    copy = saved[2]
    hits: list[bool] = []

    def recording(self, file, key):
        got = copy(self, file, key)
        hits.append(got is not None)
        return got

    _integrity.spare_core = lambda: spare
    _integrity.in_page_cache = lambda path, offsets: cached
    _manifest.ShardReader._copy = recording
    try:
        yield hits
    finally:
        _integrity.spare_core, _integrity.in_page_cache, _manifest.ShardReader._copy = saved


def _plain_load(root: str, stage: int):
    """A fresh optimizer loaded from ``root`` with no check: what every load must give."""
    from ds_zero import load_sharded_checkpoint

    plain = _zero(make_model(torch.float32, seed=3), stage)
    load_sharded_checkpoint(Path(root) / "zero", plain)
    return plain


def _assert_loaded_alike(zero, plain) -> None:
    got, expected = _state(zero), _state(plain)
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))
    for p, q in zip(zero.module.parameters(), plain.module.parameters()):
        assert torch.equal(p, q)


def _load_body(rank: int, world_size: int, *, root: str, stage: int, cached: bool = True) -> bool:
    from ds_zero import load_sharded_checkpoint, start_verification

    plain = _plain_load(root, stage)
    zero = _zero(make_model(torch.float32, seed=3), stage)
    with _hashed_ahead(True, cached) as hits, start_verification(root) as pending:
        load_sharded_checkpoint(Path(root) / "zero", zero, verified=pending)
    _assert_loaded_alike(zero, plain)
    return bool(hits) and all(hits)


@needs_copies
@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_full_load_reads_the_copies_after_the_verdict(
    tmp_path: Path, stage: int, world_size: int
) -> None:
    run_on_ranks(_save, world_size, root=str(tmp_path), stage=stage, timeout=300)
    copied = run_on_ranks(_load_body, world_size, root=str(tmp_path), stage=stage, timeout=300)
    assert all(copied), copied  # every range read came from a verified copy


@needs_copies
def test_a_full_load_from_the_disk_without_buffers_copies_the_shard_once_mapped(
    tmp_path: Path,
) -> None:
    """From a cold disk a shard file whose pieces have no buffers of the load's to go to is not
    hashed ahead (its copies would be the check's, beside the loader's unpickling of the index;
    see [Note: hashing ahead of the loader]); once the loader has mapped it, the threads copy
    it as they hash it, and the load reads every range from those copies after the verdict:
    the plain load's values."""
    run_on_ranks(_save, 1, root=str(tmp_path), stage=2, timeout=300)
    (copied,) = run_on_ranks(_load_body, 1, root=str(tmp_path), stage=2, cached=False, timeout=300)
    assert copied


def _unfit_body(rank: int, world_size: int, *, root: str, copying_rank: int) -> tuple[bool, str]:
    """Load into the saved model plus one trainable weight at its end (held by the last rank
    only), rank ``copying_rank`` reading from copies after the verdict, the other before it:
    whether this rank's own reading failed, and the error it raised."""
    from ds_zero import CheckpointError, load_sharded_checkpoint, start_verification
    from ds_zero._manifest import ShardReader

    failed = []
    lookup = ShardReader.lookup

    def recording(self, name, start, stop, values=None):
        try:
            return lookup(self, name, start, stop, values)
        except CheckpointError:
            failed.append(name)
            raise

    model = make_model(torch.float32, seed=3)
    model.extra = torch.nn.Parameter(torch.zeros(40))
    zero = _zero(model, 2)
    before = _state(zero)
    ShardReader.lookup = recording
    try:
        with _hashed_ahead(spare=rank == copying_rank), start_verification(root) as pending:
            load_sharded_checkpoint(Path(root) / "zero", zero, verified=pending)
    except CheckpointError as exc:
        assert all(torch.equal(a, b) for a, b in zip(_state(zero), before))
        return bool(failed), str(exc)
    finally:
        ShardReader.lookup = lookup
    return bool(failed), "loaded"


@needs_copies
@pytest.mark.parametrize("copying_rank", [0, 1], ids=["failing-rank-reads-first", "after"])
def test_a_read_failing_after_the_verdict_is_every_ranks_error(
    tmp_path: Path, copying_rank: int
) -> None:
    """The weight the checkpoint lacks is looked up on rank 1 only; rank 1 reads before the
    verdict (its failure joins the verdict) or after it (told through ``agree_reads``): both
    ranks raise the same error, naming the weight, and neither hangs."""
    run_on_ranks(_save, 2, root=str(tmp_path), stage=2, timeout=300)
    results = run_on_ranks(
        _unfit_body, 2, root=str(tmp_path), copying_rank=copying_rank, timeout=120
    )
    (failed_0, error_0), (failed_1, error_1) = results
    assert not failed_0 and failed_1, results
    assert error_0 == error_1 and "'extra'" in error_0, results


def test_each_rank_checks_the_shard_file_it_reads_and_the_rest_is_balanced() -> None:
    """``share``: rank r checks ``zero/zero_shards_rank<r>.pt`` (the file it reads on the world
    size that saved it, and copies as it hashes it), whatever the sizes; every other file (a
    shard file past the world size, model-parallel folders, the rest) goes to the least-loaded
    rank, the biggest first; each file to exactly one rank."""
    from ds_zero._directory_manifest import share

    files = {
        "zero/zero_shards_rank00000.pt": {"bytes": 100},
        "zero/zero_shards_rank00001.pt": {"bytes": 300},  # bigger: balancing alone gives it to 0
        "zero/zero_shards_rank00002.pt": {"bytes": 50},  # past a world of 2
        "zero_mp01/zero_shards_rank00000.pt": {"bytes": 40},
        "mp_rank_00_model_states.pt": {"bytes": 120},
        "rng_state_rank00000.pt": {"bytes": 5},
    }
    mine = [share(files, rank, 2) for rank in range(2)]
    assert "zero/zero_shards_rank00000.pt" in mine[0]
    assert "zero/zero_shards_rank00001.pt" in mine[1]
    assert sorted(mine[0] + mine[1]) == sorted(files)
    # rank 0 holds 100 bytes to rank 1's 300: the rest go to it until it holds more (314)
    assert mine[0] == [
        "mp_rank_00_model_states.pt",
        "zero/zero_shards_rank00000.pt",
        "zero/zero_shards_rank00002.pt",
        "zero_mp01/zero_shards_rank00000.pt",
    ]
    assert mine[1] == ["zero/zero_shards_rank00001.pt", "rng_state_rank00000.pt"]
    assert share(files, 0, 1) == sorted(files, key=lambda n: -files[n]["bytes"])


def _into_body(
    rank: int, world_size: int, *, root: str, stage: int, cached: bool = True
) -> list[bool]:
    """A full load with the pieces copied, as hashed, into the optimizer's new buffers
    (``shard_destinations`` handed to ``start_verification(into=...)``): the plain load's
    values, and each elementwise state of each master is the very buffer the threads wrote."""
    from ds_zero import load_sharded_checkpoint, start_verification

    plain = _plain_load(root, stage)
    zero = _zero(make_model(torch.float32, seed=3), stage)
    places = zero.shard_destinations(Path(root) / "zero")
    assert places, "the checkpoint was saved on this world size: every range is one piece"
    into = {f"zero/{file}": tensors for file, tensors in places.items()}
    written = {
        t.untyped_storage().data_ptr()
        for tensors in places.values()
        for key, t in tensors.items()
        if not key.endswith("/param")
    }
    with _hashed_ahead(True, cached), start_verification(root, into=into) as pending:
        assert all(pending.copying_into(Path(root) / name) for name in into)
        load_sharded_checkpoint(Path(root) / "zero", zero, verified=pending)
    _assert_loaded_alike(zero, plain)
    held = [
        value.untyped_storage().data_ptr() in written
        for master in zero.masters
        for value in zero.optimizer.state.get(master, {}).values()
        if torch.is_tensor(value) and value.dim() == 1
    ]
    assert zero.layout._load_buffers is None  # taken by the load
    return held


@needs_copies
@pytest.mark.parametrize(
    ("stage", "world_size", "cached"),
    [(2, 1, True), (2, 2, True), (3, 1, True), (3, 2, True), (2, 2, False), (3, 2, False)],
    ids=["2-1", "2-2", "3-1", "3-2", "2-2-cold", "3-2-cold"],
)
def test_the_pieces_are_copied_into_the_optimizers_buffers_as_hashed(
    tmp_path: Path, stage: int, world_size: int, cached: bool
) -> None:
    """No copy of a range on the loading thread: the optimizer's state after the load is the
    memory the checksum threads copied the pieces into (ds-zero's [Note: copying the pieces
    into the optimizer's buffers]), from a cold disk too (see [Note: hashing ahead of the
    loader])."""
    run_on_ranks(_save, world_size, root=str(tmp_path), stage=stage, timeout=300)
    held = run_on_ranks(
        _into_body, world_size, root=str(tmp_path), stage=stage, cached=cached, timeout=300
    )
    assert all(h and all(h) for h in held), held


def _into_refused_body(rank: int, world_size: int, *, root: str) -> str:
    from ds_zero import CheckpointError, load_sharded_checkpoint, start_verification

    zero = _zero(make_model(torch.float32, seed=3), 2)
    before = _state(zero)
    into = {f"zero/{f}": t for f, t in zero.shard_destinations(Path(root) / "zero").items()}
    try:
        with _hashed_ahead(spare=True), start_verification(root, into=into) as pending:
            load_sharded_checkpoint(Path(root) / "zero", zero, verified=pending)
    except CheckpointError as exc:
        assert all(torch.equal(a, b) for a, b in zip(_state(zero), before))
        assert zero.layout._load_buffers is None
        return str(exc)
    return "loaded"


@needs_copies
def test_a_damaged_piece_copied_into_the_buffers_is_refused_and_nothing_changes(
    tmp_path: Path,
) -> None:
    import json

    run_on_ranks(_save, 2, root=str(tmp_path), stage=2, timeout=300)
    name = "zero/zero_shards_rank00001.pt"
    entries = json.loads((tmp_path / "ds_manifest.json").read_text())["files"][name]["tensors"]
    moment = next(n for n in entries if n.endswith("/exp_avg"))
    data = bytearray((tmp_path / name).read_bytes())
    data[int(entries[moment]["offset"]) + 3] ^= 0x10
    (tmp_path / name).write_bytes(bytes(data))
    results = run_on_ranks(_into_refused_body, 2, root=str(tmp_path), timeout=300)
    assert results[0] == results[1] and f"{name} corrupted" in results[0], results
    assert repr(moment) in results[0], results
