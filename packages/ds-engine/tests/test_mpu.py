"""Custom model parallelism through an ``mpu``: a column/row-parallel MLP (written here) trained
by the engine, with gradients reduced over the mpu's data-parallel group only and clipped by the
global norm (sharded parameters summed over the model-parallel group, replicated ones counted
once), matches the full MLP trained and clipped in a single process."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from torch import nn

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _engine_testing import HIDDEN, config, loss_of, make_dataset, make_mlp

CLIP = 0.05  # below every step's norm, so each step is clipped by a different factor


class _CopyToModelParallel(torch.autograd.Function):
    """Identity forward; the backward sums the input gradient over the model-parallel group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        import ds_comm

        grad = grad.clone()
        ds_comm.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromModelParallel(torch.autograd.Function):
    """Sums partial outputs over the model-parallel group; identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        import ds_comm

        x = x.clone()
        ds_comm.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ParallelMLP(nn.Module):
    """``full`` (Linear, ReLU, Dropout, Linear) split Megatron-style: the first layer by output
    columns, the second by input rows; the second bias is replicated."""

    def __init__(self, full: nn.Sequential, rank: int, size: int, group) -> None:
        super().__init__()
        width = HIDDEN // size
        cols = slice(rank * width, (rank + 1) * width)
        self.group = group
        self.up = nn.Linear(full[0].in_features, width)
        self.down = nn.Linear(width, full[3].out_features, bias=False)
        self.down_bias = nn.Parameter(full[3].bias.detach().clone())
        with torch.no_grad():
            self.up.weight.copy_(full[0].weight[cols])
            self.up.bias.copy_(full[0].bias[cols])
            self.down.weight.copy_(full[3].weight[:, cols])
        for p in (self.up.weight, self.up.bias, self.down.weight):
            p.model_parallel = True  # split over the group; down_bias is replicated
        self.cols = cols

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToModelParallel.apply(x, self.group)
        partial = self.down(torch.relu(self.up(x)))
        return _ReduceFromModelParallel.apply(partial, self.group) + self.down_bias


def _reference(model: nn.Module, batches: list[list[torch.Tensor]]) -> tuple[dict, list[float]]:
    """Single-process Adam, clipped to ``CLIP``: the final weights and each step's norm."""
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    norms = []
    for batch in batches:
        optimizer.zero_grad()
        loss_of(model, batch).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _mpu_body(rank: int, world_size: int, *, stage: int) -> float:
    import ds_comm
    import ds_engine
    from ds_zero import GatheredParameters

    mp = 2
    dp = world_size // mp
    mpu = ds_comm.Mpu(ds_comm.ProcessGrid(ds_comm.ProcessTopology(["data", "model"], [dp, mp])))
    mp_rank, dp_rank = mpu.get_model_parallel_rank(), mpu.get_data_parallel_rank()
    assert mpu.get_data_parallel_world_size() == dp

    micro, steps = 4, 4
    data = make_dataset(micro * dp * steps)
    rows = micro * dp
    batches = [[t[i * rows : (i + 1) * rows] for t in data.tensors] for i in range(steps)]
    reference, ref_norms = _reference(make_mlp(), batches)
    model = ParallelMLP(make_mlp(), mp_rank, mp, mpu.get_model_parallel_group())
    cfg = config(
        train_micro_batch_size_per_gpu=micro,
        zero_optimization={"stage": stage},
        gradient_clipping=CLIP,
    )
    engine, *_ = ds_engine.initialize(model=model, config=cfg, mpu=mpu)
    assert engine.train_batch_size() == micro * dp  # the triad uses the data-parallel size
    norms = []
    for x, y in batches:
        mine = slice(dp_rank * micro, (dp_rank + 1) * micro)
        engine.backward(nn.functional.mse_loss(engine(x[mine]), y[mine]))
        engine.step()
        norms.append(engine.get_global_grad_norm())
    for norm, ref in zip(norms, ref_norms, strict=True):
        assert abs(norm - ref) <= 1e-5 * ref, (norms, ref_norms)
    cols = model.cols
    pairs = [
        (model.up.weight, reference["0.weight"][cols]),
        (model.up.bias, reference["0.bias"][cols]),
        (model.down.weight, reference["3.weight"][:, cols]),
        (model.down_bias, reference["3.bias"]),
    ]
    with GatheredParameters([a for a, _ in pairs]) if stage == 3 else nullcontext():
        return max((a.detach() - b).abs().max().item() / b.abs().max().item() for a, b in pairs)


# world 2: mp=2 x dp=1; world 4: mp=2 x dp=2. The default run covers both worlds and both
# default-run stages once each; the rest of the cross product is in the slow tier.
@pytest.mark.parametrize(
    ("world_size", "stage"),
    [
        (2, 0),
        (4, 2),
        *(
            pytest.param(world, stage, marks=pytest.mark.slow)
            for world, stage in [(2, 2), (4, 0), (2, 1), (4, 1), (2, 3), (4, 3)]
        ),
    ],
)
def test_column_row_parallel_mlp_clipped_matches_the_full_mlp(world_size: int, stage: int) -> None:
    errors = run_on_ranks(_mpu_body, world_size, stage=stage, timeout=300, fresh=True)
    assert max(errors) < 1e-5
