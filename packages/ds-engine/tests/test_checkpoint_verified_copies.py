"""A ZeRO-3 weights-only load takes the fp32 masters from the copies its checksum threads made
while hashing them (ds-zero's [Note: copying while verifying]): the weights are the ones a load
reading the file gives; bytes rewritten in the file after the verdict are not loaded; and a copy
changed while it was copied is refused, even when the file matches its manifest again by the
verdict."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _copying_loads import hashed_ahead, write_at
from _engine_testing import IN, config, loss_of, make_dataset, make_mlp

TAG = "t"
SHARD = "zero/zero_shards_rank00000.pt"


def _engine(seed: int):
    import ds_engine

    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}  # every weight partitioned
    engine, *_ = ds_engine.initialize(model=make_mlp(seed), config=config(zero_optimization=zero))
    return engine


def _save_body(rank: int, world_size: int, *, root: str) -> None:
    engine = _engine(0)
    engine.backward(loss_of(engine, list(make_dataset(4).tensors)))
    engine.step()
    engine.save_checkpoint(root, tag=TAG)


def _load_body(
    rank: int,
    world_size: int,
    *,
    root: str,
    copy: bool,
    before_verdict: tuple[int, bytes] | None = None,
    after_verdict: tuple[int, bytes] | None = None,
) -> dict[str, Any]:
    """A weights-only load with the shard file hashed ahead (a spare core, the file cached),
    copying while hashing or not; ``before_verdict``: ``(offset, bytes)`` written into the
    shard file once its hashing is done and before the verdict; ``after_verdict``: just after
    it. Returns the weights and how many master lookups came from the copies, or the error
    that refused the load."""
    from ds_zero import CheckpointError, GatheredParameters, _manifest

    reader = _manifest.ShardReader
    lookup = reader._copy
    copied: list[bool] = []

    def recording_copy(self, file, key):
        got = lookup(self, file, key)
        copied.append(got is not None)
        return got

    reader._copy = recording_copy
    engine = _engine(5)
    shard = Path(root) / TAG / SHARD
    try:
        with hashed_ahead(
            shard, copy=copy, before_verdict=before_verdict, after_verdict=after_verdict
        ):
            engine.load_checkpoint(root, tag=TAG, load_optimizer_states=False)
    except CheckpointError as exc:
        return {"refused": str(exc)}
    finally:
        reader._copy = lookup
    params = list(engine.module.parameters())
    with GatheredParameters(params):
        weights = [p.detach().clone() for p in params]
    return {"weights": weights, "copied": sum(copied), "lookups": len(copied)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("copies") / "ckpt"
    run_on_ranks(_save_body, 1, root=str(root), timeout=300)
    return root


def _master(root: Path) -> tuple[int, int]:
    """Offset and byte count of the shard file's first fp32 master."""
    manifest = json.loads((root / TAG / "ds_manifest.json").read_text())
    entries = manifest["files"][SHARD]["tensors"]
    name = min((n for n in entries if n.endswith("/param")), key=lambda n: entries[n]["offset"])
    return int(entries[name]["offset"]), int(entries[name]["nbytes"])


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _load(root: Path, **kwargs: Any) -> dict[str, Any]:
    (result,) = run_on_ranks(_load_body, 1, root=str(root), timeout=300, **kwargs)
    return result


needs_kernel = pytest.mark.skipif(
    not __import__("ds_native").native_available(),
    reason="ds-native's C extension is not built: nothing is copied while hashing",
)


def _copy_of(saved: Path, folder: Path) -> Path:
    shutil.copytree(saved, folder)
    return folder


@needs_kernel
def test_the_masters_come_from_the_copies_and_equal_a_read_of_the_file(saved: Path) -> None:
    copying, reading = _load(saved, copy=True), _load(saved, copy=False)
    assert copying["copied"] == copying["lookups"] > 0
    assert reading["copied"] == 0
    assert _same(copying["weights"], reading["weights"])


@needs_kernel
def test_bytes_rewritten_after_the_verdict_are_not_loaded(saved: Path, tmp_path: Path) -> None:
    """A master rewritten in place between the verdict and its use: the copy path loads what
    was checked; reading the file after the verdict (the path without the kernel) loads the
    new bytes, unchecked."""
    offset, nbytes = _master(saved)
    rewrite = (offset, bytes(nbytes))  # the master zeroed
    reference = _load(saved, copy=False)["weights"]
    copying = _load(_copy_of(saved, tmp_path / "a"), copy=True, after_verdict=rewrite)
    assert _same(copying["weights"], reference)
    reading = _load(_copy_of(saved, tmp_path / "b"), copy=False, after_verdict=rewrite)
    assert not _same(reading["weights"], reference)  # the window the copies close


@needs_kernel
def test_a_master_changed_while_copied_is_refused_though_restored(
    saved: Path, tmp_path: Path
) -> None:
    """A master corrupted while it was copied and hashed, and restored before the verdict: the
    load is refused, naming the file (what was read differs from the manifest), so the
    corrupted copy is never used, though the file matches its manifest again."""
    root = _copy_of(saved, tmp_path / "ckpt")
    offset, _ = _master(root)
    good = (root / TAG / SHARD).read_bytes()[offset : offset + 4]
    write_at(root / TAG / SHARD, offset, bytes(b ^ 0x40 for b in good))
    result = _load(root, copy=True, before_verdict=(offset, good))
    assert f"{SHARD} corrupted" in result["refused"], result


def _wide_engine(seed: int):
    import ds_engine

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, 1024), torch.nn.Linear(1024, 1024))
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    engine, *_ = ds_engine.initialize(model=model, config=config(zero_optimization=zero))
    return engine


def _weights(engine: Any) -> list[torch.Tensor]:
    from ds_zero import GatheredParameters

    params = list(engine.module.parameters())
    with GatheredParameters(params):
        return [p.detach().clone() for p in params]


def _two_loads_body(rank: int, world_size: int, *, root: str) -> dict[str, Any]:
    """Save two checkpoints of a model with 4 MiB of masters, then load the first into one
    engine and the second into another, in this process, copying while hashing. Returns each
    engine's weights as saved and after both loads, and the copy buffers kept after each
    load."""
    from ds_zero import _integrity, _verified_copies

    saved_weights = []
    for seed in (1, 2):
        engine = _wide_engine(seed)
        engine.save_checkpoint(root, tag=f"s{seed}")
        saved_weights.append(_weights(engine))
    saved = _integrity.spare_core, _integrity.in_page_cache
    _integrity.spare_core = lambda: True  # hashed (and copied) ahead, as on a spare core
    _integrity.in_page_cache = lambda path, offsets: True
    _verified_copies._kept.clear()  # an earlier test's, in this worker (it may be too small)
    kept = []
    try:
        first, second = _wide_engine(3), _wide_engine(4)
        first.load_checkpoint(root, tag="s1", load_optimizer_states=False)
        kept.append([id(r) for r in _verified_copies._kept])
        second.load_checkpoint(root, tag="s2", load_optimizer_states=False)
        kept.append([id(r) for r in _verified_copies._kept])
    finally:
        _integrity.spare_core, _integrity.in_page_cache = saved
    return {"saved": saved_weights, "loaded": [_weights(first), _weights(second)], "kept": kept}


@needs_kernel
def test_a_second_load_reuses_the_first_loads_copy_buffer_and_leaves_its_weights(
    tmp_path: Path,
) -> None:
    """The copy buffer of a masters-only load is kept for the next load (ds-zero's [Note: copy
    buffers kept for the next load]): the second load copies into the same one, and the
    first engine's weights, taken out of that buffer by its load, are not changed by it."""
    from ds_zero._verified_copies import huge_pages_offered

    if not huge_pages_offered():
        pytest.skip("this kernel offers no transparent huge pages: copies use torch.empty")
    (result,) = run_on_ranks(_two_loads_body, 1, root=str(tmp_path / "ckpt"), timeout=300)
    assert len(result["kept"][0]) == 1 and result["kept"][1] == result["kept"][0]
    for loaded, saved in zip(result["loaded"], result["saved"], strict=True):
        assert _same(loaded, saved)
    assert not _same(result["saved"][0], result["saved"][1])
