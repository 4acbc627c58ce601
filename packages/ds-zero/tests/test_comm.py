"""Gradient reduction during backward: when each stage communicates, overlap with async handles,
stage 2 never holding the full gradient, unused parameters, and misuse errors."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _ds_zero_testing import adam, global_batches, make_model, micro_batches

BUCKET = 1500


def _zero(stage: int, **section):
    import torch

    from ds_zero import ZeroConfig, ZeroOptimizer

    model = make_model(torch.float32)
    config = ZeroConfig.from_dict(
        {"stage": stage, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET, **section}
    )
    return model, ZeroOptimizer(model, adam(list(model.parameters())), config)


def _ops_per_step_body(rank: int, world_size: int, *, stage: int, accum: int) -> dict:
    import torch

    import ds_comm
    from ds_zero import ZeroConfig, ZeroOptimizer

    model = make_model(torch.float32)
    config = ZeroConfig(stage=stage, reduce_bucket_size=BUCKET, allgather_bucket_size=10**9)
    zero = ZeroOptimizer(
        model, adam(list(model.parameters())), config, gradient_accumulation_steps=accum
    )
    previous = ds_comm.configure(enabled=True, prof_all=True)
    logger = ds_comm.get_comms_logger()
    logger.reset()
    try:
        batch = global_batches(1, 4 * world_size * accum)[0]
        for micro in micro_batches(batch, rank, world_size, accum):
            zero.backward(model(micro))
            zero.step()
        counts = Counter(r.op for r in logger.records)
    finally:
        ds_comm.configure(previous)
        logger.reset()
    units = sum(len(g.units) for g in zero.groups)
    return {"units": units, **counts}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_each_stage_reduces_when_deepspeed_does(world_size: int, stage: int) -> None:
    counts = run_on_ranks(_ops_per_step_body, world_size, stage=stage, accum=4, timeout=300)[0]
    units = counts["units"]
    assert units > 4  # the bucket size cuts the model into several units
    if stage == 0:  # one all-reduce per unit, at the boundary only
        assert counts["all_reduce"] == units
        assert "reduce_scatter_tensor" not in counts
        assert "all_gather_into_tensor" not in counts
    else:  # stage 1: once at the boundary; stage 2: in every micro-batch
        assert counts["reduce_scatter_tensor"] == units * (4 if stage == 2 else 1)
        assert counts["all_gather_into_tensor"] == 1  # one all-gather bucket holds everything
        assert counts.get("all_reduce") == 1, counts  # the gradient norm over the shards


def _overlap_body(rank: int, world_size: int, *, overlap: bool) -> dict:
    model, zero = _zero(2, overlap_comm=overlap)
    seen = {"in_flight": 0, "max_grad_numel": 0, "staging_buffers": 0}

    def watch(_: object) -> None:
        # Runs after ZeRO's own hook on every parameter, while backward is still going.
        alive = sum(p.grad.numel() for p in model.parameters() if p.grad is not None)
        seen["max_grad_numel"] = max(seen["max_grad_numel"], alive)
        seen["in_flight"] = max(seen["in_flight"], zero.reducer.in_flight)
        staging = zero.reducer._staging
        allocated = staging.allocated if staging is not None else 0
        seen["staging_buffers"] = max(seen["staging_buffers"], allocated)

    handles = [p.register_post_accumulate_grad_hook(watch) for p in model.parameters()]
    for batch in global_batches(2, 4 * world_size):
        zero.backward(model(next(micro_batches(batch, rank, world_size, 1))))
        assert zero.reducer.in_flight == 0  # all waited for by the end of backward
        zero.step()
    for handle in handles:
        handle.remove()
    seen["largest_unit"] = max(u.padded_numel for g in zero.groups for u in g.units)
    seen["model_numel"] = sum(p.numel() for p in model.parameters())
    return seen


@pytest.mark.parametrize("world_size", [2, 4])
def test_overlap_comm_keeps_reductions_in_flight_during_backward(world_size: int) -> None:
    on = run_on_ranks(_overlap_body, world_size, overlap=True, timeout=300)[0]
    off = run_on_ranks(_overlap_body, world_size, overlap=False, timeout=300)[0]
    assert on["in_flight"] >= 1
    assert off["in_flight"] == 0  # each reduction waited for in the hook that launched it


@pytest.mark.parametrize("world_size", [2])
def test_stage_2_never_holds_the_full_gradient(world_size: int) -> None:
    # (On one rank the shard is the whole gradient: stage 2 keeps it as stage 1 does, with no
    # staging buffer; test_gradient_buffers.py checks that.)
    seen = run_on_ranks(_overlap_body, world_size, overlap=True, timeout=300)[0]
    # Gradients are copied into a staging buffer and freed as autograd finishes them.
    assert seen["max_grad_numel"] <= seen["largest_unit"] < seen["model_numel"] / 4
    assert seen["staging_buffers"] <= 2  # double buffering


def _unused_body(rank: int, world_size: int, *, stage: int, ignore: bool) -> str:
    import torch

    from ds_zero import ZeroConfig, ZeroOptimizer

    model = make_model(torch.float32)
    model.unused = torch.nn.Linear(4, 4)
    before = model.unused.weight.detach().clone()
    config = ZeroConfig(stage=stage, reduce_bucket_size=BUCKET, ignore_unused_parameters=ignore)
    zero = ZeroOptimizer(model, adam(list(model.parameters())), config)
    batch = global_batches(1, 4 * world_size)[0]
    try:
        zero.backward(model(next(micro_batches(batch, rank, world_size, 1))))
    except RuntimeError as exc:
        return str(exc)
    zero.step()
    assert torch.equal(model.unused.weight, before)  # a zero gradient moves nothing in Adam
    return "trained"


@pytest.mark.parametrize("stage", [0, 2])
def test_unused_parameters_are_reduced_as_zeros_or_rejected(stage: int) -> None:
    assert run_on_ranks(_unused_body, 2, stage=stage, ignore=True, timeout=300) == ["trained"] * 2
    messages = run_on_ranks(_unused_body, 2, stage=2, ignore=False, timeout=300)
    assert all("ignore_unused_parameters" in m for m in messages)


def _plain_backward_body(rank: int, world_size: int) -> str:
    model, _ = _zero(2)
    try:
        model(global_batches(1, 4)[0]).backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_plain_loss_backward_is_an_error() -> None:
    (message,) = run_on_ranks(_plain_backward_body, 1, timeout=300)
    assert "zero_optimizer.backward(loss)" in message


def _zero_grad_body(rank: int, world_size: int, *, stage: int, clear: bool) -> list[float]:
    import torch

    from ds_zero import ZeroConfig, ZeroOptimizer

    model = make_model(torch.float32)
    config = ZeroConfig(stage=stage, reduce_bucket_size=BUCKET)
    zero = ZeroOptimizer(
        model, adam(list(model.parameters())), config, gradient_accumulation_steps=2
    )
    first, second = micro_batches(global_batches(1, 8 * world_size)[0], rank, world_size, 2)
    loss = model(first)
    before = [p.detach().clone() for p in model.parameters()]
    if clear:
        zero.backward(loss)
        model.zero_grad(set_to_none=True)  # drops the first micro-batch's gradients
    else:
        zero.backward(loss * 0.0)
    assert not zero.step().boundary  # not the boundary: only counts the micro-batch
    zero.backward(model(second))
    zero.step()
    assert zero.global_steps == 1
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return [p.detach().sum().item() for p in model.parameters()]


@pytest.mark.parametrize("stage", [0, 1])
def test_model_zero_grad_between_micro_batches_is_respected(stage: int) -> None:
    cleared = run_on_ranks(_zero_grad_body, 2, stage=stage, clear=True, timeout=300)
    zeroed = run_on_ranks(_zero_grad_body, 2, stage=stage, clear=False, timeout=300)
    assert cleared == zeroed


def _accumulation_style_body(rank: int, world_size: int, *, stage: int, every: bool) -> list:
    import torch

    from ds_zero import ZeroConfig, ZeroOptimizer

    model = make_model(torch.float32)
    config = ZeroConfig(stage=stage, reduce_bucket_size=BUCKET)
    zero = ZeroOptimizer(
        model, adam(list(model.parameters())), config, gradient_accumulation_steps=3
    )
    for batch in global_batches(2, 6 * world_size):
        for micro in micro_batches(batch, rank, world_size, 3):
            zero.backward(model(micro))
            if every:
                zero.step()  # DeepSpeed's engine: after every micro-batch
        if not every:
            zero.step()  # torch style: once per window
    assert zero.global_steps == 2 and zero.micro_steps == 6
    return [p.detach().sum().item() for p in model.parameters()]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_step_every_micro_batch_or_once_per_window_is_the_same(stage: int) -> None:
    every = run_on_ranks(_accumulation_style_body, 2, stage=stage, every=True, timeout=300)
    once = run_on_ranks(_accumulation_style_body, 2, stage=stage, every=False, timeout=300)
    assert every == once
