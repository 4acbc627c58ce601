"""``param_views``: a parameter's fp32 master, Adam state and gradient read and written through
its ZeRO optimizer at stages 0-3 on 1, 2 and 4 gloo ranks, compared with single-process torch
Adam on the full batch computed inside each rank."""

from __future__ import annotations

import pytest

from ds_testing import run_on_ranks

STEPS = 3
ROWS = 8
TOL = 1e-5


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    # odd sizes: parameters straddle the shards of small units
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Tanh(), nn.Linear(3, 1))


def _batches():
    import torch

    gen = torch.Generator().manual_seed(1)
    return [torch.randn(ROWS, 5, generator=gen) for _ in range(STEPS + 2)]


def _loss(model, x):
    return model(x).pow(2).mean()


def _close(a, b) -> bool:
    import torch

    return torch.allclose(a.float(), b.float(), rtol=TOL, atol=TOL)


def _body(rank: int, world_size: int, stage: int) -> None:
    import torch

    import ds_zero

    model, ref = _model(), _model()
    section = {"stage": stage, "reduce_bucket_size": 40, "allgather_bucket_size": 40}
    if stage == 3:
        section.update(sub_group_size=30, stage3_param_persistence_threshold=4)
    zero = ds_zero.build_zero_optimizer(
        model, torch.optim.Adam(model.parameters(), lr=1e-2), ds_zero.ZeroConfig.from_dict(section)
    )
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    refs = dict(ref.named_parameters())

    def train(x) -> None:
        zero.backward(_loss(model, x.chunk(world_size)[rank]))
        _loss(ref, x).backward()
        for n in names:  # the reduced gradient, between backward and step
            grad = ds_zero.param_views(params[n]).full("grad")
            assert _close(grad, refs[n].grad), (stage, n, "grad")
        zero.step()
        ref_opt.step()
        ref_opt.zero_grad()

    batches = _batches()
    for x in batches[:STEPS]:
        train(x)
    for n in names:
        views = ds_zero.param_views(params[n])
        assert views is not None and views.shape == refs[n].shape
        assert _close(views.full("param"), refs[n]), (stage, n)
        for key in ("exp_avg", "exp_avg_sq"):
            assert _close(views.full(key), ref_opt.state[refs[n]][key]), (stage, n, key)
        assert views.replicated == (world_size == 1 or stage == 0)
        if not views.replicated:  # ranges are disjoint and cover the parameter
            held = torch.tensor([views.stop - views.start])
            torch.distributed.all_reduce(held)
            assert int(held) == refs[n].numel()

    # full setters: write the same change on both sides; training follows it
    w0, b0 = names[0], names[1]
    with torch.no_grad():
        new_w = refs[w0].detach() * 0.5
        ds_zero.param_views(params[w0]).set_full("param", new_w)
        refs[w0].copy_(new_w)
        new_m = torch.full_like(refs[b0], 0.25)
        ds_zero.param_views(params[b0]).set_full("exp_avg", new_m)
        ref_opt.state[refs[b0]]["exp_avg"].copy_(new_m)
    assert _close(ds_zero.param_views(params[w0]).full("param"), new_w)
    assert _close(ds_zero.param_views(params[b0]).full("exp_avg"), new_m)
    for x in batches[STEPS:]:
        train(x)
    for n in names:
        assert _close(ds_zero.param_views(params[n]).full("param"), refs[n]), (stage, n, "after")

    # a full value is a copy, never a view of the optimizer's storage
    full = ds_zero.param_views(params[w0]).full("exp_avg")
    full.add_(1.0)
    assert not torch.equal(ds_zero.param_views(params[w0]).full("exp_avg"), full)

    # local round trip, and an unknown key names what exists
    views = ds_zero.param_views(params[w0])
    local = views.local("exp_avg_sq").clone()
    views.set_local("exp_avg_sq", local * 2)
    assert torch.equal(views.local("exp_avg_sq"), local * 2)
    with pytest.raises(KeyError, match="exp_avg"):
        views.local("momentum_buffer")
    with pytest.raises(ValueError, match="whole"):
        views.set_full("param", torch.zeros(3))


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_param_views_match_torch_adam(stage: int, world_size: int) -> None:
    run_on_ranks(_body, world_size, stage)


def test_frozen_or_foreign_parameter_has_no_views() -> None:
    import torch

    import ds_zero

    model = _model()
    model[0].weight.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    zero = ds_zero.build_zero_optimizer(model, torch.optim.Adam(trainable), ds_zero.ZeroConfig())
    assert ds_zero.param_views(model[0].weight) is None
    assert ds_zero.param_views(torch.nn.Parameter(torch.zeros(2))) is None
    assert ds_zero.param_views(model[2].weight) is not None
    del zero
    import gc

    gc.collect()
    assert ds_zero.param_views(model[2].weight) is None  # the record is weak


def _variant_body(rank: int, world_size: int, stage: int, variant: str) -> None:
    import torch

    import ds_optim
    import ds_zero

    model, ref = _model(), _model()
    section: dict = {"stage": stage, "reduce_bucket_size": 40, "allgather_bucket_size": 40}
    if variant in ("offload", "nvme"):
        section["offload_optimizer"] = {"device": "cpu"}
        if variant == "nvme":  # the moments on NVMe between steps (ZeRO-Infinity at stage 3)
            import tempfile

            section["offload_optimizer"] = {"device": "nvme", "nvme_path": tempfile.mkdtemp()}
        optimizer = ds_optim.CPUAdam(model.parameters(), lr=1e-2)
    else:
        model.to(torch.bfloat16)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    zero = ds_zero.build_zero_optimizer(model, optimizer, ds_zero.ZeroConfig.from_dict(section))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    x = _batches()[0]
    for _ in range(2):
        zero.backward(_loss(model, x.to(next(model.parameters()).dtype).chunk(world_size)[rank]))
        zero.step()
        _loss(ref, x).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    named = dict(model.named_parameters())
    for name, want in ref.named_parameters():
        views = ds_zero.param_views(named[name])
        got = views.full("param")
        assert got.dtype == torch.float32
        if variant in ("offload", "nvme"):
            assert torch.allclose(got, want, rtol=TOL, atol=TOL), name
            assert torch.allclose(views.full("exp_avg"), ref_opt.state[want]["exp_avg"], atol=TOL)
        else:  # the fp32 master, whose bf16 rounding is the model's weight
            assert torch.allclose(got, want, atol=5e-2), name
            if stage < 3:
                assert torch.equal(got.to(torch.bfloat16), named[name].detach())
    first = next(iter(named))
    value = torch.linspace(-1, 1, named[first].numel() if stage < 3 else 35).view(7, 5)
    views = ds_zero.param_views(named[first])
    views.set_full("param", value)
    assert torch.equal(views.full("param"), value)
    if stage < 3:  # the model's weight followed, in its dtype
        assert torch.equal(named[first].detach(), value.to(named[first].dtype))


@pytest.mark.parametrize(
    ("stage", "variant"),
    [(2, "bf16"), (3, "bf16"), (1, "offload"), (2, "offload"), (3, "offload"), (3, "nvme")],
)
def test_param_views_mixed_precision_and_offload(stage: int, variant: str) -> None:
    run_on_ranks(_variant_body, 2, stage, variant)
