"""``deepspeed.utils``' parameter access (``safe_get_full_fp32_param`` and siblings) under the
engine at ZeRO stages 0-3 on 1, 2 and 4 gloo ranks, compared with single-process torch Adam on
the full batch computed inside each rank: getters return the reference's weights, Adam moments
and gradients; setters round-trip and change the trajectory as the same change does in the
reference."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _engine_testing import config, loss_of, make_mlp

MICRO = 2
TOL = dict(rtol=1e-5, atol=1e-6)


def _batches(world_size: int, count: int, seed: int = 5):
    import torch

    gen = torch.Generator().manual_seed(seed)
    rows = MICRO * world_size
    return [
        [torch.randn(rows, 8, generator=gen), torch.randn(rows, 4, generator=gen)]
        for _ in range(count)
    ]


def _body(rank: int, world_size: int, stage: int) -> None:
    import torch

    import ds_engine as deepspeed
    from ds_engine.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_get_local_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_grad,
        safe_set_full_optimizer_state,
        safe_set_local_optimizer_state,
    )

    model, ref = make_mlp(), make_mlp()
    section = {"stage": stage, "reduce_bucket_size": 50, "allgather_bucket_size": 50}
    if stage == 3:
        section["stage3_param_persistence_threshold"] = 10
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=config(train_micro_batch_size_per_gpu=MICRO, zero_optimization=section),
    )
    device = engine.device  # the accelerator's: the reference trains there too
    ref.to(device)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    names = [n for n, _ in ref.named_parameters()]
    ours = dict(model.named_parameters())
    refs = dict(ref.named_parameters())

    def step(batch, *, change_grad: bool = False) -> None:
        batch = [t.to(device) for t in batch]
        mine = [t.chunk(world_size)[rank] for t in batch]
        engine.backward(loss_of(engine, mine))
        loss_of(ref, batch).backward()
        for n in names:
            assert torch.allclose(safe_get_full_grad(ours[n]), refs[n].grad, **TOL), (stage, n)
        if change_grad:  # the step uses the gradient that was set
            new = torch.ones_like(refs[names[0]].grad)
            safe_set_full_grad(ours[names[0]], new)
            refs[names[0]].grad.copy_(new)
        engine.step()
        ref_opt.step()
        ref_opt.zero_grad()

    batches = _batches(world_size, 6)
    for batch in batches[:3]:
        step(batch)
    for n in names:
        assert torch.allclose(safe_get_full_fp32_param(ours[n]), refs[n], **TOL), (stage, n)
        for key in ("exp_avg", "exp_avg_sq"):
            want = ref_opt.state[refs[n]][key]
            assert torch.allclose(safe_get_full_optimizer_state(ours[n], key), want, **TOL), key

    w, b = names[0], names[1]
    with torch.no_grad():
        new_w = refs[w].detach() * -0.5
        safe_set_full_fp32_param(ours[w], new_w)
        refs[w].copy_(new_w)
        new_m = torch.full_like(refs[b], 0.1)
        safe_set_full_optimizer_state(ours[b], new_m, "exp_avg")
        ref_opt.state[refs[b]]["exp_avg"].copy_(new_m)
    assert torch.allclose(safe_get_full_fp32_param(ours[w]), new_w, **TOL)
    step(batches[3], change_grad=True)
    for batch in batches[4:]:
        step(batch)
    for n in names:
        assert torch.allclose(safe_get_full_fp32_param(ours[n]), refs[n], **TOL), (stage, n, "set")

    local = safe_get_local_optimizer_state(ours[w], "exp_avg_sq").clone()
    safe_set_local_optimizer_state(ours[w], local + 1, "exp_avg_sq")
    assert torch.equal(safe_get_local_optimizer_state(ours[w], "exp_avg_sq"), local + 1)
    assert safe_get_local_fp32_param(ours[w]).dim() == 1
    with pytest.raises(KeyError, match="exp_avg"):
        safe_get_full_optimizer_state(ours[w], "momentum_buffer")
    from ds_engine.utils import get_full_hp_param, set_full_hp_param

    moment = get_full_hp_param(ours[w], "exp_avg")
    set_full_hp_param(ours[w], moment * 3, "exp_avg")
    assert torch.allclose(get_full_hp_param(ours[w], "exp_avg"), moment * 3)
    assert torch.equal(get_full_hp_param(ours[w]), safe_get_full_fp32_param(ours[w]))


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_safe_get_set_match_torch_adam(stage: int, world_size: int) -> None:
    run_on_ranks(_body, world_size, stage)


def test_parameters_without_zero_optimizer() -> None:
    import torch

    from ds_engine.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_set_full_fp32_param,
    )

    p = torch.nn.Parameter(torch.ones(3))
    assert safe_get_full_fp32_param(p) is None
    assert safe_get_full_optimizer_state(p, "exp_avg") is None
    assert safe_get_full_grad(p) is None
    p.grad = torch.full((3,), 2.0)
    assert torch.equal(safe_get_full_grad(p), p.grad)
    with pytest.raises(ValueError, match="not trained by a ZeRO optimizer"):
        safe_set_full_fp32_param(p, torch.zeros(3))
