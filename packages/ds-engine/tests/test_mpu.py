"""Custom model parallelism through an ``mpu``: a column/row-parallel MLP (written here) trained
by the engine, with gradients reduced over the mpu's data-parallel group only, matches the full
MLP trained in a single process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _engine_testing import HIDDEN, config, make_dataset, make_mlp, reference_adam


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
        self.cols = cols

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToModelParallel.apply(x, self.group)
        partial = self.down(torch.relu(self.up(x)))
        return _ReduceFromModelParallel.apply(partial, self.group) + self.down_bias


def _mpu_body(rank: int, world_size: int, *, stage: int) -> float:
    import ds_comm
    import ds_engine

    mp = 2
    dp = world_size // mp
    mpu = ds_comm.Mpu(ds_comm.ProcessGrid(ds_comm.ProcessTopology(["data", "model"], [dp, mp])))
    mp_rank, dp_rank = mpu.get_model_parallel_rank(), mpu.get_data_parallel_rank()
    assert mpu.get_data_parallel_world_size() == dp

    micro, steps = 4, 4
    data = make_dataset(micro * dp * steps)
    rows = micro * dp
    batches = [[t[i * rows : (i + 1) * rows] for t in data.tensors] for i in range(steps)]
    reference = reference_adam(make_mlp(), batches)
    model = ParallelMLP(make_mlp(), mp_rank, mp, mpu.get_model_parallel_group())
    cfg = config(train_micro_batch_size_per_gpu=micro, zero_optimization={"stage": stage})
    clipped = {**cfg, "gradient_clipping": 1.0}
    try:
        ds_engine.initialize(
            model=ParallelMLP(make_mlp(), mp_rank, mp, None), config=clipped, mpu=mpu
        )
        raise AssertionError("clipping with model parallelism must be refused")
    except ds_engine.ConfigError as exc:
        assert "model-parallel" in str(exc)
    engine, *_ = ds_engine.initialize(model=model, config=cfg, mpu=mpu)
    assert engine.train_batch_size() == micro * dp  # the triad uses the data-parallel size
    for x, y in batches:
        mine = slice(dp_rank * micro, (dp_rank + 1) * micro)
        engine.backward(nn.functional.mse_loss(engine(x[mine]), y[mine]))
        engine.step()
    cols = model.cols
    pairs = [
        (model.up.weight, reference["0.weight"][cols]),
        (model.up.bias, reference["0.bias"][cols]),
        (model.down.weight, reference["3.weight"][:, cols]),
        (model.down_bias, reference["3.bias"]),
    ]
    return max((a.detach() - b).abs().max().item() / b.abs().max().item() for a, b in pairs)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [0, 2])
def test_column_row_parallel_mlp_matches_the_full_mlp(world_size: int, stage: int) -> None:
    errors = run_on_ranks(_mpu_body, world_size, stage=stage, timeout=300, fresh=True)
    assert max(errors) < 1e-5
