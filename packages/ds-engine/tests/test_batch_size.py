"""Changing the batch size during training (``set_train_batch_size``,
``set_train_micro_batch_size``), ``was_step_applied``, ``backward``'s return value and
``step(lr_kwargs=)``, against a single-process reference computed in the same rank."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _engine_testing import config, loss_of, make_dataset, make_mlp, max_error, reference_adam

MICRO = 4


def _batches(world_size: int, rows: list[int]) -> list[list]:
    """Global batches of the given sizes, consecutive slices of one dataset."""
    data = make_dataset(sum(rows) * world_size)
    out, start = [], 0
    for n in rows:
        out.append([t[start : start + n * world_size] for t in data.tensors])
        start += n * world_size
    return out


def _set_batch_body(rank: int, world_size: int) -> dict:
    import ds_engine

    engine, *_ = ds_engine.initialize(
        model=make_mlp(), config=config(train_micro_batch_size_per_gpu=MICRO)
    )
    batches = _batches(world_size, [MICRO, MICRO, 2 * MICRO, 2 * MICRO])
    applied, returned, losses = [], [], []
    for index, batch in enumerate(batches):
        if index == 2:
            engine.set_train_batch_size(2 * MICRO * world_size)  # gas 1 -> 2
        mine = [t.chunk(world_size)[rank] for t in batch]
        for micro in range(engine.gradient_accumulation_steps()):
            part = [t[micro * MICRO : (micro + 1) * MICRO] for t in mine]
            loss = loss_of(engine, part)
            returned.append(float(engine.backward(loss)) / float(loss))
            engine.step()
            applied.append(engine.was_step_applied())
            losses.append(float(loss))
    info_after_batch = engine.get_batch_info()
    errors = []
    for bad in (2 * MICRO * world_size + 1, 0, True):
        with pytest.raises(ValueError) as caught:
            engine.set_train_batch_size(bad)
        errors.append(str(caught.value))
    engine.set_train_micro_batch_size(2)
    reference = reference_adam(make_mlp(), batches)
    return {
        "applied": applied,
        "returned": returned,
        "info": info_after_batch,
        "info_micro": engine.get_batch_info(),
        "errors": errors,
        "error": max_error(engine.module, reference),
        "steps": (engine.global_steps, engine.global_samples),
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_set_train_batch_size_changes_accumulation(world_size: int) -> None:
    for got in run_on_ranks(_set_batch_body, world_size, timeout=300):
        assert got["applied"] == [True, True, False, True, False, True]
        assert got["returned"] == pytest.approx([1, 1, 0.5, 0.5, 0.5, 0.5])
        assert got["info"] == (2 * MICRO * world_size, MICRO, 2)
        assert got["info_micro"] == (2 * 2 * world_size, 2, 2)
        assert "must be a positive multiple" in got["errors"][0]
        assert "expected an integer" in got["errors"][2]
        assert got["error"] < 1e-5
        assert got["steps"] == (4, 2 * MICRO * world_size + 2 * 2 * MICRO * world_size)


def _overflow_body(rank: int, world_size: int) -> dict:
    import ds_engine

    engine, *_ = ds_engine.initialize(
        model=make_mlp(), config=config(fp16={"enabled": True, "initial_scale_power": 4})
    )
    data = make_dataset(4 * world_size)
    mine = [t.chunk(world_size)[rank] for t in data.tensors]
    engine.backward(loss_of(engine, mine) * float("inf"))
    engine.step()
    skipped = (engine.was_step_applied(), engine.skipped_steps)
    engine.backward(loss_of(engine, mine))
    engine.step()
    return {"skipped": skipped, "applied": engine.was_step_applied()}


@pytest.mark.parametrize("world_size", [1, 2])
def test_was_step_applied_is_false_on_an_overflow_skip(world_size: int) -> None:
    for got in run_on_ranks(_overflow_body, world_size, timeout=300):
        assert got == {"skipped": (False, 1), "applied": True}


class _CountingScheduler:
    """A client scheduler whose ``step`` takes a keyword (DeepSpeed passes ``lr_kwargs``)."""

    def __init__(self) -> None:
        self.increments: list[int] = []

    def step(self, increment: int = 1) -> None:
        self.increments.append(increment)


def _lr_kwargs_body(rank: int, world_size: int) -> list[int]:
    import ds_engine

    scheduler = _CountingScheduler()
    engine, _, _, returned = ds_engine.initialize(
        model=make_mlp(), config=config(gradient_accumulation_steps=2), lr_scheduler=scheduler
    )
    assert returned is scheduler
    data = make_dataset(8)
    for micro in range(4):
        engine.backward(loss_of(engine, [t[micro * 2 : micro * 2 + 2] for t in data.tensors]))
        engine.step(lr_kwargs={"increment": 10 + micro})
    engine.backward(loss_of(engine, list(data.tensors)))
    engine.step()
    return scheduler.increments


def test_step_passes_lr_kwargs_to_the_scheduler_at_the_boundary() -> None:
    # Steps at micro-batches 1 and 3 (the boundaries); none at 4 (mid-window).
    assert run_on_ranks(_lr_kwargs_body, 1, timeout=300) == [[11, 13]]
