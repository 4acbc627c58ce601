"""A ZeRO-2 load takes the model file's weights from the copies its checksum threads made while
hashing the file (ds-zero's [Note: copying the file the loader reads whole]): the loader maps
the file for its structure only; the weights equal a plain read's; bytes rewritten in the file
after the verdict are not loaded; a tensor changed while it was copied is refused though
restored by the verdict; and the copy buffer is kept for the next load. In fp32 the copies
are the fp32 masters themselves (ds-engine's [Note: weights loaded into the masters]): the
weights and the masters equal the saved ones on 1 and 2 ranks, and a refused load leaves the
model and its masters as they were."""

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


def _engine(seed: int, bf16: bool = False, stage: int = 2, offload: bool = False):
    """ZeRO-2 over 8 MiB of weights: a model file too big to hash on the loading thread."""
    import ds_engine

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, 1024), torch.nn.Linear(1024, 2048))
    zero: dict[str, Any] = {"stage": stage}
    if offload:  # the masters in host memory of the optimizer's own
        zero["offload_optimizer"] = {"device": "cpu"}
    section = {"zero_optimization": zero, "bf16": {"enabled": bf16}}
    engine, *_ = ds_engine.initialize(model=model, config=config(**section))
    return engine


def _weights(engine: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _masters_fit(engine: Any) -> bool:
    """Whether the fp32 masters hold what the parameters hold (rebuilt from them: the same)."""
    masters = [m.clone() for m in engine.optimizer.masters]
    engine.optimizer.refresh_fp32_params()
    return all(torch.equal(a, b) for a, b in zip(masters, engine.optimizer.masters))


def _save_body(rank: int, world_size: int, *, root: str, bf16: bool = False) -> list[torch.Tensor]:
    engine = _engine(0, bf16)
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
    bf16: bool = False,
    stage: int = 2,
    offload: bool = False,
) -> dict[str, Any]:
    """``loads`` weights-only loads with a core to spare, copying while hashing or not;
    ``before_verdict``: ``(offset, bytes)`` written into the model file once it is hashed (and
    copied) and before the verdict; ``after_verdict``: just after it. Returns the weights,
    whether the loader mapped the file, and the copy buffers kept before the loads and after
    each, or the error that refused the load; and whether the weights were copied into the
    fp32 masters, the weights before the loads, and whether the masters then held the weights."""
    from ds_zero import CheckpointError, _integrity, _verified_copies

    pending = _integrity.PendingVerification
    asked, asked_into = pending.copying, pending.copying_into
    mapped: list[bool] = []
    into: list[bool] = []

    def copying(self, path):
        mapped.append(asked(self, path))
        return mapped[-1]

    def copying_into(self, path):
        into.append(asked_into(self, path))
        return into[-1]

    pending.copying, pending.copying_into = copying, copying_into
    engine = _engine(5, bf16, stage, offload)
    before = _weights(engine)
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
        unchanged = _same(_weights(engine), before)
        return {
            "refused": str(exc),
            "into": into,
            "unchanged": unchanged,
            "fit": _masters_fit(engine),
        }
    finally:
        pending.copying, pending.copying_into = asked, asked_into
    weights = _weights(engine)
    return {
        "weights": weights,
        "mapped": mapped,
        "kept": kept,
        "into": into,
        "fit": _masters_fit(engine),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[torch.Tensor]]:
    root = tmp_path_factory.mktemp("model_copies") / "ckpt"
    (weights,) = run_on_ranks(_save_body, 1, root=str(root), timeout=300)
    return root, weights


@pytest.fixture(scope="module")
def saved_bf16(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[torch.Tensor]]:
    root = tmp_path_factory.mktemp("model_copies_bf16") / "ckpt"
    (weights,) = run_on_ranks(_save_body, 1, root=str(root), bf16=True, timeout=300)
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
def test_the_weights_come_from_the_masters_and_equal_the_saved_ones(
    saved: tuple[Path, list[torch.Tensor]],
) -> None:
    """fp32: the weights are copied into the fp32 masters as they are hashed, and from there
    into the parameters; the masters are not rebuilt from the parameters after."""
    root, weights = saved
    copying, reading = _load(root, copy=True, loads=2), _load(root, copy=False)
    assert copying["mapped"] == [True, True] and reading["mapped"] == [False]
    assert copying["into"] == [True, True] and reading["into"] == [False]
    assert _same(copying["weights"], weights) and _same(reading["weights"], weights)
    assert copying["fit"] and reading["fit"]


@pytest.mark.parametrize(("stage", "offload"), [(1, False), (2, False), (2, True)])
@needs_kernel
def test_on_two_ranks_each_rank_loads_its_masters_and_the_weights_agree(
    saved: tuple[Path, list[torch.Tensor]], stage: int, offload: bool
) -> None:
    """On two ranks each loads into its own masters (the parameters that straddle the two
    partitions are rebuilt from the weights), in host memory with ``offload_optimizer``
    too; every rank ends with the saved weights."""
    root, weights = saved
    results = run_on_ranks(
        _load_body, 2, root=str(root), copy=True, stage=stage, offload=offload, timeout=300
    )
    assert any(r["into"] == [True] for r in results)  # the rank that hashes the model file
    for result in results:
        assert _same(result["weights"], weights) and result["fit"]


@needs_kernel
def test_the_weights_come_from_the_copies_and_equal_the_saved_ones(
    saved_bf16: tuple[Path, list[torch.Tensor]],
) -> None:
    """bf16: the masters are fp32, the file bf16; the weights come from the check's copies."""
    root, weights = saved_bf16
    copying = _load(root, copy=True, loads=2, bf16=True)
    reading = _load(root, copy=False, bf16=True)
    assert copying["mapped"] == [True, True] and reading["mapped"] == [False]
    assert copying["into"] == [False, False]
    assert _same(copying["weights"], weights) and _same(reading["weights"], weights)
    from ds_zero._verified_copies import huge_pages_offered

    before, first, second = (set(k) for k in copying["kept"])
    if huge_pages_offered():  # the first load's buffer, kept and lent to the second (the
        # worker process may keep one from an earlier test, which the first load then reuses)
        assert len(first - before) == 1 or (before and first == before)
        assert second == first
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
    # the corrupted bytes went into a master before the verdict: it was put back
    assert result["into"] == [True] and result["unchanged"] and result["fit"]
