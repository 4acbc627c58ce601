"""A ZeRO-2 load takes the model file's weights from the copies its checksum threads made while
hashing the file (ds-zero's [Note: copying the file the loader reads whole]): the loader maps
the file for its structure only; the weights equal a plain read's; bytes rewritten in the file
after the verdict are not loaded; a tensor changed while it was copied is refused though
restored by the verdict; and the copy buffer is kept for the next load."""

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
from _engine_testing import IN, config

TAG = "t"
MODEL_FILE = "mp_rank_00_model_states.pt"

needs_kernel = pytest.mark.skipif(
    not __import__("ds_native").native_available(),
    reason="ds-native's C extension is not built: nothing is copied while hashing",
)


def _engine(seed: int):
    """ZeRO-2 over 8 MiB of weights: a model file too big to hash on the loading thread."""
    import ds_engine

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, 1024), torch.nn.Linear(1024, 2048))
    engine, *_ = ds_engine.initialize(model=model, config=config(zero_optimization={"stage": 2}))
    return engine


def _weights(engine: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _save_body(rank: int, world_size: int, *, root: str) -> list[torch.Tensor]:
    engine = _engine(0)
    engine.save_checkpoint(root, tag=TAG)
    return _weights(engine)


def _load_body(
    rank: int,
    world_size: int,
    *,
    root: str,
    copy: bool,
    loads: int = 1,
    before_verdict: tuple[int, bytes] | None = None,
    after_verdict: tuple[int, bytes] | None = None,
) -> dict[str, Any]:
    """``loads`` weights-only loads with a core to spare, copying while hashing or not;
    ``before_verdict``: ``(offset, bytes)`` written into the model file once it is hashed (and
    copied) and before the verdict; ``after_verdict``: just after it. Returns the weights,
    whether the loader mapped the file, and the copy buffers kept before the loads and after
    each, or the error that refused the load."""
    from ds_zero import CheckpointError, _integrity, _verified_copies

    pending = _integrity.PendingVerification
    asked = pending.copying
    mapped: list[bool] = []

    def copying(self, path):
        mapped.append(asked(self, path))
        return mapped[-1]

    pending.copying = copying
    engine = _engine(5)
    kept = [[id(r) for r in _verified_copies._kept]]  # an earlier test's, in this process
    model_file = Path(root) / TAG / MODEL_FILE
    try:
        with hashed_ahead(
            model_file, copy=copy, before_verdict=before_verdict, after_verdict=after_verdict
        ):
            for _ in range(loads):
                engine.load_checkpoint(root, tag=TAG, load_optimizer_states=False)
                kept.append([id(r) for r in _verified_copies._kept])
    except CheckpointError as exc:
        return {"refused": str(exc)}
    finally:
        pending.copying = asked
    return {"weights": _weights(engine), "mapped": mapped, "kept": kept}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[torch.Tensor]]:
    root = tmp_path_factory.mktemp("model_copies") / "ckpt"
    (weights,) = run_on_ranks(_save_body, 1, root=str(root), timeout=300)
    return root, weights


def _load(root: Path, **kwargs: Any) -> dict[str, Any]:
    (result,) = run_on_ranks(_load_body, 1, root=str(root), timeout=300, **kwargs)
    return result


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _first_weight(root: Path) -> tuple[int, int]:
    """Offset and byte count of the model file's first weight."""
    manifest = json.loads((root / TAG / "ds_manifest.json").read_text())
    entries = manifest["files"][MODEL_FILE]["tensors"]
    name = min(entries, key=lambda n: entries[n]["offset"])
    return int(entries[name]["offset"]), int(entries[name]["nbytes"])


def _copy_of(root: Path, folder: Path) -> Path:
    shutil.copytree(root, folder)
    return folder


@needs_kernel
def test_the_weights_come_from_the_copies_and_equal_the_saved_ones(
    saved: tuple[Path, list[torch.Tensor]],
) -> None:
    root, weights = saved
    copying, reading = _load(root, copy=True, loads=2), _load(root, copy=False)
    assert copying["mapped"] == [True, True] and reading["mapped"] == [False]
    assert _same(copying["weights"], weights) and _same(reading["weights"], weights)
    from ds_zero._verified_copies import huge_pages_offered

    before, first, second = (set(k) for k in copying["kept"])
    if huge_pages_offered():  # the first load's buffer, kept and lent to the second
        assert len(first - before) == 1 and second == first
    else:  # torch.empty's memory: nothing to keep
        assert before == first == second


@needs_kernel
def test_bytes_rewritten_after_the_verdict_are_not_loaded(
    saved: tuple[Path, list[torch.Tensor]], tmp_path: Path
) -> None:
    """The loader mapped the file: its weights would read a rewrite made after the verdict, had
    they not been swapped for the copies that were checked."""
    root, weights = saved
    offset, nbytes = _first_weight(root)
    result = _load(_copy_of(root, tmp_path / "a"), copy=True, after_verdict=(offset, bytes(nbytes)))
    assert result["mapped"] == [True]
    assert _same(result["weights"], weights)


@needs_kernel
def test_a_weight_changed_while_copied_is_refused_though_restored(
    saved: tuple[Path, list[torch.Tensor]], tmp_path: Path
) -> None:
    root = _copy_of(saved[0], tmp_path / "ckpt")
    offset, _ = _first_weight(root)
    good = (root / TAG / MODEL_FILE).read_bytes()[offset : offset + 4]
    write_at(root / TAG / MODEL_FILE, offset, bytes(b ^ 0x40 for b in good))
    result = _load(root, copy=True, before_verdict=(offset, good))
    assert f"{MODEL_FILE} corrupted" in result["refused"], result
