"""What a pipeline needs from ``ZeroOptimizer``: backward from received output gradients
(``grad_tensors``), and a gradient norm summed over the pipeline group (``norm_group``) that
counts a tied parameter held by two stages once (``norm_exclude``).

Ranks form a 2 (pipe) x N (data) grid; each pipe stage trains its own model (seeded by stage).
The reference norm is computed in-process from both stages' full-batch gradients.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _ds_zero_testing import global_batches, make_model, micro_batches

STAGES = 2
ROWS = 8
RELATIVE_TOLERANCE = 1e-6


def _reference_norm(batch, exclude_on_last_stage: bool) -> float:
    squares = 0.0
    for stage in range(STAGES):
        model = make_model(__import__("torch").float32, seed=stage)
        model(batch).backward()
        for name, p in model.named_parameters():
            if exclude_on_last_stage and stage == STAGES - 1 and name == "tok.weight":
                continue
            squares += float(p.grad.double().pow(2).sum())
    return math.sqrt(squares)


def _norm_body(rank: int, world_size: int, *, stage: int, exclude: bool) -> float:
    import torch
    import torch.distributed as dist

    from ds_zero import ZeroConfig, ZeroOptimizer

    dp = world_size // STAGES
    stage_id, data_rank = divmod(rank, dp)
    dp_groups = [dist.new_group([s * dp + d for d in range(dp)]) for s in range(STAGES)]
    pipe_groups = [dist.new_group([s * dp + d for s in range(STAGES)]) for d in range(dp)]
    model = make_model(torch.float32, seed=stage_id)
    excluded = [model.tok.weight] if exclude and stage_id == STAGES - 1 else []
    zero = ZeroOptimizer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        ZeroConfig.from_dict({"stage": stage, "reduce_bucket_size": 1500}),
        group=dp_groups[stage_id],
        norm_group=pipe_groups[data_rank],
        norm_exclude=excluded,
        gradient_clipping=1e-3,
    )
    (batch,) = global_batches(1, ROWS)
    (mine,) = micro_batches(batch, data_rank, dp, 1)
    # A pipeline's last stage hands backward its outputs and their gradients, unscaled.
    loss = model(mine)
    zero.backward([loss], grad_tensors=[torch.ones_like(loss)])
    assert not zero.step().skipped
    expected = _reference_norm(batch, exclude)
    norm = zero.get_global_grad_norm()
    assert norm is not None
    assert abs(norm - expected) <= RELATIVE_TOLERANCE * expected, (norm, expected)
    return norm


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_norm_over_pipeline_group(world_size: int, stage: int) -> None:
    norms = run_on_ranks(_norm_body, world_size, stage=stage, exclude=False)
    assert len(set(norms)) == 1  # every stage and replica clips with the same norm


@pytest.mark.parametrize("stage", [0, 1])
def test_excluded_tied_weight_counted_once(stage: int) -> None:
    norms = run_on_ranks(_norm_body, 4, stage=stage, exclude=True)
    assert len(set(norms)) == 1


def _grad_tensors_body(rank: int, world_size: int) -> None:
    import torch

    from ds_zero import ZeroConfig, ZeroOptimizer

    (batch,) = global_batches(1, ROWS)
    (mine,) = micro_batches(batch, rank, world_size, 1)
    reference = make_model(torch.float32)
    reference(batch).backward()
    model = make_model(torch.float32)
    zero = ZeroOptimizer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        ZeroConfig.from_dict({"stage": 0}),
        gradient_accumulation_steps=1,
    )
    # Split the graph where a pipeline would: backward from hidden states and their gradient.
    hidden = model.tok(mine[:, :-1]) + model.pos(torch.arange(mine.shape[1] - 1))
    detached = hidden.detach().requires_grad_()
    x = detached
    for block in model.blocks:
        x = block(x)
    logits = model.head(model.norm(x))
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), mine[:, 1:].reshape(-1))
    # The "last stage" part backward, then the "first stage" from the received gradient.
    head_grads = torch.autograd.grad(loss, [detached, *model.parameters()], allow_unused=True)
    zero.backward(hidden, grad_tensors=[head_grads[0]])
    full = dict(model.named_parameters())
    for p, g in zip(model.parameters(), head_grads[1:]):
        if g is not None:
            p.grad.add_(g)  # the rest of the model's share, as the other stage would hold it
    for name, p in reference.named_parameters():
        local = full[name].grad
        assert torch.allclose(local, p.grad, rtol=1e-5, atol=1e-7), name


def test_backward_from_received_gradients() -> None:
    run_on_ranks(_grad_tensors_body, 1)
