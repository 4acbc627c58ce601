"""The GPU tier of ``deepspeed.utils`` and ``deepspeed.checkpointing`` (``pytest -m gpu``;
skipped without CUDA), on one GPU: activation checkpointing replays the CUDA generator and the
RNG tracker (CUDA states) and brings CPU-held inputs back to the GPU; ``OnDevice`` builds on the
GPU; timers read CUDA events; parameter views of a ZeRO optimizer on the GPU (stages 1-3) equal
single-process torch Adam on the same device."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def _block_grads(ckpt, device):
    import torch
    from torch import nn

    from ds_engine import checkpointing

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Dropout(0.5), nn.Linear(64, 16))
    block.to(device)

    def run(x):
        with checkpointing.get_cuda_rng_tracker().fork():
            x = nn.functional.dropout(x, 0.3, training=True)
        return block(x)

    x = torch.randn(8, 16, device=device, requires_grad=True)
    torch.cuda.manual_seed(3)
    checkpointing.get_cuda_rng_tracker().reset()
    checkpointing.get_cuda_rng_tracker().add("model-parallel-rng", 11)
    out = run(x) if ckpt is None else ckpt(run, x)
    out.pow(2).sum().backward()
    return [p.grad for p in block.parameters()] + [x.grad]


@pytest.mark.parametrize("in_cpu", [False, True])
def test_checkpoint_replays_cuda_rng(in_cpu: bool) -> None:
    import torch

    from ds_engine import checkpointing

    device = torch.device("cuda", torch.cuda.current_device())
    checkpointing.configure(None, checkpoint_in_cpu=in_cpu, synchronize=True)
    try:
        got = _block_grads(checkpointing.checkpoint, device)
        want = _block_grads(None, device)
        for a, b in zip(got, want):
            assert a.device.type == "cuda"
            assert torch.allclose(a, b, atol=1e-6, rtol=0), (a - b).abs().max()
        if not in_cpu:
            got = _block_grads(checkpointing.non_reentrant_checkpoint, device)
            for a, b in zip(got, want):
                assert torch.allclose(a, b, atol=1e-6, rtol=0)
    finally:
        checkpointing.configure(None)


def test_rng_tracker_uses_the_cuda_generator() -> None:
    import torch

    from ds_engine.checkpointing import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(5)
    cpu_before = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        tracked = torch.rand(4, device="cuda")
    torch.cuda.manual_seed(5 + 2718)
    assert torch.equal(torch.rand(4, device="cuda"), tracked)
    assert torch.equal(torch.get_rng_state(), cpu_before)  # the CPU generator is not the one


def test_on_device_cuda() -> None:
    import torch

    from ds_engine.utils import OnDevice

    with OnDevice(dtype=torch.bfloat16, device="cuda:0"):
        layer = torch.nn.Linear(32, 32)
    assert layer.weight.device.type == "cuda" and layer.weight.dtype == torch.bfloat16


def test_timers_use_cuda_events() -> None:
    import torch

    from ds_engine.utils.timer import SynchronizedWallClockTimer

    timers = SynchronizedWallClockTimer()
    a = torch.randn(2048, 2048, device="cuda")
    timers("mm").start()
    for _ in range(10):
        a = a @ a.T / 2048
    timers("mm").stop()
    assert timers("mm").elapsed() > 0.0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_param_views_on_gpu(stage: int) -> None:
    import torch
    from torch import nn

    import ds_zero

    device = torch.device("cuda", torch.cuda.current_device())

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(device)

    model, ref = make(), make()
    section = {"stage": stage, "reduce_bucket_size": 20}
    if stage == 3:
        section["stage3_param_persistence_threshold"] = 0
    zero = ds_zero.build_zero_optimizer(
        model, torch.optim.Adam(model.parameters(), lr=1e-2), ds_zero.ZeroConfig.from_dict(section)
    )
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    x = torch.randn(6, 5, device=device)
    for _ in range(3):
        zero.backward(model(x).pow(2).mean())
        zero.step()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    named = dict(model.named_parameters())
    for name, want in ref.named_parameters():
        views = ds_zero.param_views(named[name])
        got = views.full("param")
        assert got.device.type == "cuda"
        assert torch.allclose(got, want, atol=1e-5), name
        assert torch.allclose(views.full("exp_avg"), ref_opt.state[want]["exp_avg"], atol=1e-6)
