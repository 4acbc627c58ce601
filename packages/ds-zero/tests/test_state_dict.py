"""Sharded checkpoints: saved on N ranks, loaded on M (the universal format needs no
``elastic_checkpoint``), training continues exactly as an uninterrupted single-process run;
atomic directories; in-memory state dicts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _ds_zero_testing import (
    Recipe,
    adam,
    global_batches,
    make_model,
    micro_batches,
    parameter_error,
    reference_train,
)

STEPS, SAVE_AT, ROWS = 8, 4, 16


def _zero(stage: int, *, seed: int = 0, **section):
    import torch

    from ds_zero import ZeroConfig, ZeroOptimizer

    model = make_model(torch.float32, seed=seed)
    config = ZeroConfig.from_dict({"stage": stage, "reduce_bucket_size": 2000, **section})
    return model, ZeroOptimizer(model, adam(list(model.parameters())), config)


def _train(model, zero, rank: int, world_size: int, steps: range) -> None:
    batches = global_batches(STEPS, ROWS)
    for step in steps:
        for micro in micro_batches(batches[step], rank, world_size, 1):
            zero.backward(model(micro))
            zero.step()


def _save_body(rank: int, world_size: int, *, path: str, stage: int) -> None:
    from ds_zero import save_sharded_checkpoint

    model, zero = _zero(stage)
    _train(model, zero, rank, world_size, range(SAVE_AT))
    save_sharded_checkpoint(path, zero, client_state={"model": model.state_dict(), "step": SAVE_AT})


def _resume_body(rank: int, world_size: int, *, path: str, stage: int, fp32_weights: bool) -> float:
    import torch

    from ds_zero import load_sharded_checkpoint

    # A different seed: everything must come from the checkpoint.
    model, zero = _zero(stage, seed=123, load_from_fp32_weights=fp32_weights)
    if not fp32_weights:  # the masters are rebuilt from the model's weights: load those first
        saved = torch.load(Path(path) / "client_state.pt", weights_only=False)["model"]
        model.load_state_dict(saved)
    client = load_sharded_checkpoint(path, zero)
    assert client is not None and client["step"] == SAVE_AT
    assert zero.global_steps == SAVE_AT
    _train(model, zero, rank, world_size, range(SAVE_AT, STEPS))
    reference = reference_train(
        make_model(torch.float32), global_batches(STEPS, ROWS), Recipe(adam)
    )
    return parameter_error(model, reference)


@pytest.mark.parametrize(
    ("saved_on", "loaded_on", "saved_stage", "loaded_stage", "fp32_weights"),
    [
        (4, 2, 2, 2, True),
        (2, 4, 2, 2, True),
        (4, 2, 1, 1, True),
        (2, 4, 1, 1, False),
        (2, 2, 2, 2, True),
        (4, 2, 2, 1, True),  # a stage change is a re-partition too
        (2, 1, 0, 0, True),
    ],
)
def test_resume_on_another_world_size_continues_exactly(
    tmp_path: Path,
    saved_on: int,
    loaded_on: int,
    saved_stage: int,
    loaded_stage: int,
    fp32_weights: bool,
) -> None:
    path = str(tmp_path / "ckpt")
    run_on_ranks(_save_body, saved_on, path=path, stage=saved_stage, timeout=300)
    files = sorted(p.name for p in Path(path).iterdir())
    expected = [
        "client_state.pt",
        "manifest.json",
        "scalars.pt",
        *(f"zero_shards_rank{r:05d}.pt" for r in range(saved_on)),  # stage 0 shares the writing
    ]
    assert files == sorted(expected)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no partial directory left
    errors = run_on_ranks(
        _resume_body,
        loaded_on,
        path=path,
        stage=loaded_stage,
        fp32_weights=fp32_weights,
        timeout=300,
    )
    assert max(errors) <= 1e-5, errors


def _overwrite_body(rank: int, world_size: int, *, path: str) -> list[int]:
    import torch

    from ds_zero import load_sharded_checkpoint, save_sharded_checkpoint

    model, zero = _zero(2)
    save_sharded_checkpoint(path, zero)
    _train(model, zero, rank, world_size, range(1))
    save_sharded_checkpoint(path, zero)  # replaces the first one
    expected = [t.clone() for t in zero.masters]
    _, fresh = _zero(2, seed=7)
    load_sharded_checkpoint(path, fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh.masters, expected))
    return [fresh.global_steps]


def test_saving_again_replaces_the_directory(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    assert run_on_ranks(_overwrite_body, 2, path=path, timeout=300) == [[1], [1]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _in_memory_body(rank: int, world_size: int) -> bool:
    import torch

    model, zero = _zero(1)
    _train(model, zero, rank, world_size, range(2))
    state = zero.state_dict()
    assert state["masters"][0].numel() == zero.groups[0].partition_numel
    _, other = _zero(1, seed=5)
    other.load_state_dict(state)
    same = [torch.equal(a, b) for a, b in zip(other.module.parameters(), model.parameters())]
    return all(same)


def test_state_dict_round_trip_restores_parameters() -> None:
    assert run_on_ranks(_in_memory_body, 2, timeout=300) == [True, True]


def test_replace_dir_swaps_a_finished_directory_in_whole(tmp_path: Path) -> None:
    import torch

    from ds_zero import replace_dir, save_fsynced

    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "stale.pt").write_text("old")
    partial = tmp_path / ".ckpt.partial"
    partial.mkdir()
    save_fsynced({"x": torch.arange(3)}, partial / "state.pt")
    replace_dir(partial, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no partial, no aside
    assert [p.name for p in target.iterdir()] == ["state.pt"]
    assert torch.equal(torch.load(target / "state.pt")["x"], torch.arange(3))


def _optimizer_state_body(rank: int, world_size: int, *, stage: int) -> int:
    model, zero = _zero(stage)
    _train(model, zero, rank, world_size, range(2))
    assert zero.state is zero.optimizer.state
    moments = [s for s in zero.state.values() if "exp_avg" in s]
    assert moments and all(int(s["step"]) == 2 for s in moments)
    return len(moments)


@pytest.mark.parametrize("stage", [1, 2])
def test_optimizer_state_is_the_wrapped_optimizers(stage: int) -> None:
    """``zero.state`` reads like a torch optimizer's (clients such as Lightning read it)."""
    counts = run_on_ranks(_optimizer_state_body, 2, stage=stage)
    assert counts[0] > 0
