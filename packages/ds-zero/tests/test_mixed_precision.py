"""Gradient clipping on partitioned gradients, fp16 with dynamic loss scaling, and overflow steps
skipped on every rank together."""

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

STEPS, ROWS, CLIP = 10, 16, 0.05


def _sgd(params: list) -> object:
    # Clipping is checked with SGD: Adam's update ignores the gradient's scale, and would turn
    # the rounding noise of tiny clipped elements into +-lr steps.
    import torch

    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _clipping_body(rank: int, world_size: int, *, stage: int) -> tuple[float, float]:
    import torch

    from ds_zero import ZeroConfig, ZeroOptimizer

    model = make_model(torch.float32)
    config = ZeroConfig(stage=stage, reduce_bucket_size=1500)
    zero = ZeroOptimizer(model, _sgd(list(model.parameters())), config, gradient_clipping=CLIP)
    norms = []
    for batch in global_batches(STEPS, ROWS):
        zero.backward(model(next(micro_batches(batch, rank, world_size, 1))))
        zero.step()
        norms.append(zero.get_global_grad_norm())
    # The reference, with torch's clip_grad_norm_ over the whole (unsharded) gradients.
    ref_model = make_model(torch.float32)
    reference = reference_train(ref_model, global_batches(STEPS, ROWS), Recipe(_sgd, clip=CLIP))
    ref_norms = _reference_norms(STEPS)
    assert min(ref_norms) > CLIP  # every step clips
    norm_error = max(abs(a - b) / b for a, b in zip(norms, ref_norms))
    return parameter_error(model, reference), norm_error


def _reference_norms(steps: int) -> list[float]:
    """Pre-clipping gradient norms of the reference run, step by step."""
    import torch

    model = make_model(torch.float32)
    masters = [p.detach().clone() for p in model.parameters()]
    optimizer = _sgd(masters)
    norms = []
    for batch in global_batches(steps, ROWS):
        model(batch).backward()
        for m, p in zip(masters, model.parameters()):
            m.grad, p.grad = p.grad, None
        norms.append(float(torch.nn.utils.clip_grad_norm_(masters, CLIP)))
        optimizer.step()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
    return norms


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_clipping_on_partitioned_gradients_matches_whole_gradients(
    world_size: int, stage: int
) -> None:
    for param_error, norm_error in run_on_ranks(
        _clipping_body, world_size, stage=stage, timeout=300
    ):
        assert param_error <= 1e-5
        assert norm_error <= 1e-5


def _fp16_body(rank: int, world_size: int, *, stage: int, overflow_step: int) -> dict:
    import torch

    from ds_optim import DynamicLossScaler
    from ds_zero import ZeroConfig, ZeroOptimizer

    model = make_model(torch.float16)
    scaler = DynamicLossScaler(initial_scale_power=8, hysteresis=1)
    config = ZeroConfig(stage=stage, reduce_bucket_size=1500, overlap_comm=True)
    zero = ZeroOptimizer(model, adam(list(model.parameters())), config, loss_scaler=scaler)
    skipped, scales = [], []
    for step, batch in enumerate(global_batches(STEPS, ROWS)):
        loss = model(next(micro_batches(batch, rank, world_size, 1)))
        if step == overflow_step and rank == world_size - 1:
            loss = loss * float("inf")  # only the last rank overflows
        before = [p.detach().clone() for p in model.parameters()]
        zero.backward(loss)
        skipped.append(zero.step().skipped)
        scales.append(zero.loss_scale)
        if skipped[-1]:
            assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    flat = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
    return {"skipped": skipped, "scales": scales, "checksum": flat.sum().item()}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [0, 2])
def test_an_overflow_on_one_rank_skips_the_step_on_all(world_size: int, stage: int) -> None:
    results = run_on_ranks(_fp16_body, world_size, stage=stage, overflow_step=3, timeout=300)
    expected = [step == 3 for step in range(STEPS)]
    for result in results:
        assert result["skipped"] == expected
        assert result["scales"][2] == 256.0 and result["scales"][3] == 128.0
    assert len({r["checksum"] for r in results}) == 1  # parameters identical on every rank


def _fp16_parity_body(rank: int, world_size: int) -> float:
    import torch

    from ds_optim import DynamicLossScaler
    from ds_zero import ZeroConfig, ZeroOptimizer

    model = make_model(torch.float16)
    zero = ZeroOptimizer(
        model,
        adam(list(model.parameters())),
        ZeroConfig(stage=2, reduce_bucket_size=1500),
        loss_scaler=DynamicLossScaler(initial_scale_power=8),
    )
    for batch in global_batches(STEPS, ROWS):
        zero.backward(model(next(micro_batches(batch, rank, world_size, 1))))
        assert not zero.step().skipped
    reference = reference_train(
        make_model(torch.float16), global_batches(STEPS, ROWS), Recipe(adam)
    )
    return parameter_error(model, reference)


@pytest.mark.parametrize("world_size", [1, 2])
def test_fp16_with_loss_scaling_trains_like_the_reference(world_size: int) -> None:
    assert max(run_on_ranks(_fp16_parity_body, world_size, timeout=300)) <= 5e-2
