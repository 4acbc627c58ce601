"""``deepspeed.checkpointing.checkpoint`` inside a model trained by the engine at ZeRO stages
1-3 on 1 and 2 gloo ranks: the recomputation in backward (stage 3 gathers the block's
parameters again for it) gives the weights of single-process training without checkpointing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _engine_testing import config


def _model(checkpointed: bool):
    import torch
    from torch import nn

    from ds_engine import checkpointing

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8)) for _ in range(3)
            )
            self.head = nn.Linear(8, 4)

        def forward(self, x):
            for block in self.blocks:
                x = x + (checkpointing.checkpoint(block, x) if checkpointed else block(x))
            return self.head(x)

    return Net()


def _body(rank: int, world_size: int, stage: int) -> None:
    import torch

    import ds_engine as deepspeed

    model, ref = _model(True), _model(False)
    section = {"stage": stage}
    if stage == 3:
        section["stage3_param_persistence_threshold"] = 0
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=config(train_micro_batch_size_per_gpu=2, zero_optimization=section),
    )
    device = engine.device  # the accelerator's: the reference trains there too
    ref.to(device)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(4)
    for _ in range(3):
        x, y = (
            torch.randn(2 * world_size, 8, generator=gen),
            torch.randn(2 * world_size, 4, generator=gen),
        )
        x, y = x.to(device), y.to(device)
        mine = slice(2 * rank, 2 * rank + 2)
        engine.backward(torch.nn.functional.mse_loss(engine(x[mine]), y[mine]))
        engine.step()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    from ds_engine.utils import safe_get_full_fp32_param

    for name, want in ref.named_parameters():
        got = safe_get_full_fp32_param(dict(model.named_parameters())[name])
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (stage, name)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_checkpoint_under_zero(stage: int, world_size: int) -> None:
    run_on_ranks(_body, world_size, stage)
