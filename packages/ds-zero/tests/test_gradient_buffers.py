"""Where stage 2 keeps gradients on one rank, and low-precision buffers freed between steps
(``_reduce.py``'s [Note: where gradients live]): the same training, less memory.

Each case trains the same model for 3 steps of 2 micro-batches and compares the final
parameters with a run that keeps the buffers, bit for bit: the memory changes must not change
one rounding.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _ds_zero_testing import adam, global_batches, make_model, micro_batches

ACCUM = 2


def _train(
    rank: int, world_size: int, stage: int, offload: bool, release: bool, dtype: str = "bfloat16"
) -> dict:
    import torch

    from ds_zero import ZeroConfig, ZeroOptimizer

    model = make_model(getattr(torch, dtype))
    config = ZeroConfig.from_dict(
        {
            "stage": stage,
            "offload_optimizer": {"device": "cpu" if offload else "none"},
            "overlap_comm": True,
        }
    )
    optimizer = adam(list(model.parameters()))
    zero = ZeroOptimizer(model, optimizer, config, gradient_accumulation_steps=ACCUM)
    zero.reducer.release_between_steps = release
    for batch in global_batches(3, 4 * world_size * ACCUM):
        for micro in micro_batches(batch, rank, world_size, ACCUM):
            zero.backward(model(micro))
        zero.step()
        # After the step every gradient buffer reads zero for the next window, or is freed
        # until the next backward (one rank, released). A host shard that gradients land in
        # directly is zeroed where nothing landed when it is read (settle), not by the step.
        zero.reducer.settle()
        assert all(t is None or not t.any() for t in (*zero.reducer.full, *zero.reducer.part))
        assert bool(zero.reducer._released) == (release and world_size == 1 and not offload)
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "buffers": zero.reducer.nbytes(),
    }


def _compare(a: dict, b: dict) -> None:
    import torch

    for name, value in a["params"].items():
        torch.testing.assert_close(value, b["params"][name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
def test_stage_2_on_one_rank_keeps_no_staging_buffers_and_trains_as_stage_1(offload: bool) -> None:
    """One rank has nothing to reduce: stage 2 holds no staging buffer (nor, without offload,
    a separate shard) and steps exactly as stage 1, whose gradients it now keeps the same way.
    Under offload each gradient is copied straight into the host shard and accumulated there
    in fp32, so the model is fp32 for the comparison (stage 1 sums micro-batches in the
    model's dtype, which for bf16 rounds differently)."""
    dtype = "float32" if offload else "bfloat16"
    kwargs = {"offload": offload, "release": False, "dtype": dtype}
    (stage2,) = run_on_ranks(_train, 1, stage=2, **kwargs)
    (stage1,) = run_on_ranks(_train, 1, stage=1, **kwargs)
    grads, _, staging = stage2["buffers"]
    assert staging == 0
    if not offload:
        assert grads == stage1["buffers"][0]  # one low-precision copy, as stage 1
    _compare(stage2, stage1)


def _train_with_unused_branch(rank: int, world_size: int, stage: int) -> dict:
    """3 windows of 2 micro-batches under offload; one branch gets gradients in the first
    micro-batch of window 0, the second of window 1, and never in window 2."""
    import torch

    from ds_zero import ZeroConfig, ZeroOptimizer

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"always": torch.nn.Linear(8, 8), "branch": torch.nn.Linear(8, 8)})
    config = ZeroConfig.from_dict(
        {"stage": stage, "offload_optimizer": {"device": "cpu"}, "ignore_unused_parameters": True}
    )
    zero = ZeroOptimizer(
        model, adam(list(model.parameters())), config, gradient_accumulation_steps=2
    )
    uses = [(True, False), (False, True), (False, False)]
    seen = []
    gen = torch.Generator().manual_seed(1)
    for window in uses:
        for use_branch in window:
            x = torch.randn(4, 8, generator=gen)
            y = model["always"](x) + (model["branch"](x) if use_branch else 0)
            zero.backward(y.square().mean())
        zero.reducer.settle()  # what a reader of the gradients sees before the step
        seen.append([t.clone() for t in zero.reducer.part if t is not None])
        zero.step()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": seen,
    }


def test_direct_landing_zeroes_only_what_did_not_land() -> None:
    """One rank under offload at stage 2 lands each gradient in the host shard and does not
    zero the shard between windows: a slice's first landing overwrites it, and slices nothing
    landed in read zero. A branch used in one micro-batch of a window, or in none, gives the
    gradients and the parameters of stage 1, which zeroes its shard every step."""
    import torch

    (direct,) = run_on_ranks(_train_with_unused_branch, 1, stage=2)
    (zeroed,) = run_on_ranks(_train_with_unused_branch, 1, stage=1)
    for a, b in zip(direct["grads"], zeroed["grads"]):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    _compare(direct, zeroed)


@pytest.mark.parametrize(("stage", "world_size"), [(1, 1), (2, 1), (2, 2)])
def test_freeing_low_precision_buffers_between_steps_changes_nothing(
    stage: int, world_size: int
) -> None:
    """``release_between_steps`` (the accelerator default) frees the bf16 gradients once the
    step has its fp32 copy and allocates them zeroed for the next window: same parameters."""
    kept = run_on_ranks(_train, world_size, stage=stage, offload=False, release=False)
    freed = run_on_ranks(_train, world_size, stage=stage, offload=False, release=True)
    for a, b in zip(kept, freed):
        _compare(a, b)


@pytest.mark.gpu
def test_offloaded_masters_upload_through_one_chunk() -> None:
    """An offloaded step's fp32 masters reach the device's bf16 parameters chunk by chunk
    (``upload_cast``), bit-identical to one whole-tensor cast, with a last partial chunk."""
    import torch

    from ds_zero._offload import upload_cast

    host = torch.randn(1000, dtype=torch.float32).pin_memory()
    out = upload_cast(host, torch.bfloat16, torch.device("cuda"), chunk_numel=7)
    assert out.device.type == "cuda" and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu(), host.to(torch.bfloat16), rtol=0, atol=0)
