"""More of the GPU tier (``pytest -m gpu``; skipped without CUDA): NVMe optimizer offload from a
CUDA model, and expert-parallel MoE on two ranks sharing the GPU over gloo with CUDA tensors.

NVMe offload must train exactly like CPU offload (the swap is storage, not arithmetic), and the
MoE engine must match a single-process reference holding every expert, as its CPU twin in
``test_moe.py`` does, at ZeRO stages 1-3 (stage 3 partitions each expert over its
expert-data-parallel group). One GPU cannot host two NCCL ranks, so the two-rank runs use gloo, whose
all-to-all, all-gather and all-reduce accept CUDA tensors.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _engine_testing import config, loss_of, make_dataset, make_mlp

pytestmark = pytest.mark.gpu


def _offload_train(zero: dict, steps: int) -> tuple[list[float], object]:
    import torch

    import ds_engine

    aio = {"block_size": 65536, "queue_depth": 4, "intra_op_parallelism": 2}
    engine, *_ = ds_engine.initialize(
        model=make_mlp(0), config=config(zero_optimization=zero, aio=aio, bf16={"enabled": True})
    )
    assert engine.device.type == "cuda"
    data = make_dataset(8)
    losses = []
    for step in range(steps):
        start = (step % 2) * 4
        batch = [t[start : start + 4].to(engine.device) for t in data.tensors]
        loss = loss_of(engine, batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = torch.cat([p.detach().float().reshape(-1).cpu() for p in engine.module.parameters()])
    return losses, params


def _nvme_body(rank: int, world_size: int, *, root: str, stage: int) -> bool:
    import torch

    cpu_losses, cpu_params = _offload_train(
        {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}}, steps=6
    )
    nvme = {"device": "nvme", "nvme_path": root, "pin_memory": True}
    nvme_losses, nvme_params = _offload_train({"stage": stage, "offload_optimizer": nvme}, steps=6)
    assert nvme_losses == cpu_losses, (nvme_losses, cpu_losses)
    assert torch.equal(nvme_params, cpu_params)
    assert sum(nvme_losses[-2:]) < sum(nvme_losses[:2])
    return True


@pytest.mark.parametrize("stage", [1, 2])
def test_nvme_offload_from_a_cuda_model_trains_like_cpu_offload(stage: int, tmp_path: Path) -> None:
    assert run_on_ranks(_nvme_body, 1, backend="nccl", root=str(tmp_path), stage=stage) == [True]


def _moe_parity_body(rank: int, world_size: int, *, stage: int, steps: int) -> float:
    import torch
    from test_moe import _config3, _full_model, _model, _tokens

    import ds_engine
    import ds_moe

    reference = _model(1, seed=0)
    optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for step in range(steps):  # on the CPU: the mean loss over every rank's batch
        optimizer.zero_grad()
        loss = sum(reference(_tokens(step, r)) for r in range(world_size)) / world_size
        loss.backward()
        for p in reference.parameters():  # ZeRO steps every expert, routed to or not
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        optimizer.step()

    model = _full_model(world_size, seed=0)
    engine, *_ = ds_engine.initialize(model=model, config=_config3(stage))
    assert engine.device.type == "cuda"
    assert all(p.device.type == "cuda" for p in engine.module.parameters())
    for step in range(steps):
        engine.backward(engine(_tokens(step, rank).to(engine.device)))
        engine.step()
    expected = ds_moe.expert_parallel_state_dict(
        engine.module, reference.state_dict(), engine.expert_groups
    )
    from ds_zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):  # whole weights at stage 3
        state = {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}
    worst = 0.0
    for name, value in state.items():
        ref = expected[name]
        error = (value.cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)
        worst = max(worst, error.item())
    return worst


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_expert_parallel_moe_on_two_ranks_sharing_the_gpu(stage: int) -> None:
    # Both ranks on cuda:0 (LOCAL_RANK=0), experts split 2 ways, all-to-all through gloo.
    errors = run_on_ranks(
        _moe_parity_body, 2, env={"LOCAL_RANK": "0"}, stage=stage, steps=4, timeout=300
    )
    # CUDA and CPU kernels round differently; 4 Adam steps keep that well under 1e-4.
    assert max(errors) < 1e-4, errors
