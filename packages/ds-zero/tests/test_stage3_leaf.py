"""ZeRO-3 leaf modules (``set_z3_leaf_modules``): a leaf's parameters are gathered in one fetch
at its forward and nothing inside it is hooked, so a mixture-of-experts block whose experts run
in a data-dependent order (different on each rank) works; training with a leaf equals
single-process training. Run on 1, 2 and 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_testing import run_on_ranks


class Experts(nn.Module):
    """Three experts mixed per row by a gate. With ``by_data`` they run in the order of this
    batch's mean gate score (data-dependent: different on each rank); otherwise in the order
    of the gate's weight norms (the same on every rank, changing as it trains)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(6, 3, bias=False)
        self.experts = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.by_data = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.gate(x).softmax(-1)
        key = scores.mean(0) if self.by_data else self.gate.weight.norm(dim=1)
        out = torch.zeros_like(x)
        for i in key.argsort(descending=True).tolist():
            out = out + scores[:, i : i + 1] * self.experts[i](x)
        return out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.moe = Experts()
        self.out = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.moe(torch.tanh(self.inp(x)))))


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _stage3(model: nn.Module, **extra):
    import ds_zero

    config = ds_zero.ZeroConfig.from_dict(
        {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 10**6, **extra}
    )
    return ds_zero.build_zero_optimizer(
        model, torch.optim.Adam(model.parameters(), lr=1e-2), config
    )


def _inference_body(rank: int, world_size: int) -> None:
    import ds_zero

    model, ref = _net(), _net()
    found = ds_zero.set_z3_leaf_modules(model, [Experts])
    assert found == [model.moe] and ds_zero.get_z3_leaf_modules(model) == [model.moe]
    assert ds_zero.z3_leaf_parameter(model.moe.experts[0].weight)
    zero = _stage3(model)
    gen = torch.Generator().manual_seed(10 + rank)  # each rank its own data: its own order
    for _ in range(3):
        x = torch.randn(5, 4, generator=gen)
        with torch.no_grad():
            got, want = model(x), ref(x)
        assert torch.allclose(got, want, atol=1e-6), (got, want)
    # the leaf is one fetch event; its inner modules fetch nothing
    events = zero.hooks._events
    assert model.moe.experts[0] not in events and model.moe.gate not in events
    for p in model.parameters():  # all partitioned again after the forward
        assert p.numel() == 0


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_leaf_module_data_dependent_order(world_size: int) -> None:
    run_on_ranks(_inference_body, world_size)


def _training_body(rank: int, world_size: int) -> None:
    import ds_zero

    model, ref = _net(), _net()
    model.moe.by_data = ref.moe.by_data = False  # backward order must agree across ranks
    ds_zero.set_z3_leaf_modules(model, ["Experts"])
    zero = _stage3(model)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        x = torch.randn(8, 4, generator=gen)  # the same batch everywhere: the same order
        zero.backward(model(x.chunk(world_size)[rank]).pow(2).mean())
        zero.step()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert zero.hooks.trace is not None
    assert model.moe in zero.hooks.trace and model.moe.gate not in zero.hooks.trace
    for name, p in ref.named_parameters():
        views = ds_zero.param_views(dict(model.named_parameters())[name])
        assert torch.allclose(views.full("param"), p, atol=1e-5), name


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_leaf_module_training_matches_reference(world_size: int) -> None:
    run_on_ranks(_training_body, world_size)


def test_set_and_unset_by_class_name_suffix() -> None:
    import ds_zero

    model = _net()
    with pytest.raises(ValueError, match="no module of class"):
        ds_zero.set_z3_leaf_modules(model, [nn.Conv2d])
    assert ds_zero.set_z3_leaf_modules(model, [nn.Conv2d], raise_if_not_found=False) == []
    with pytest.raises(TypeError, match="list of module classes"):
        ds_zero.set_z3_leaf_modules(model, "Experts")  # type: ignore[arg-type]
    ds_zero.set_z3_leaf_modules(model, [f"{Experts.__module__}.Experts"])
    assert ds_zero.z3_leaf_module(model.moe)
    ds_zero.unset_z3_leaf_modules(model, [Experts])
    assert not ds_zero.z3_leaf_module(model.moe)
    assert not ds_zero.z3_leaf_parameter(model.moe.gate.weight)
    found, missing = ds_zero.set_z3_leaf_modules_by_name(
        model, ["moe", "nope"], raise_if_not_found=False
    )
    assert found == [model.moe] and missing == ["nope"]
    found, missing = ds_zero.set_z3_leaf_modules_by_suffix(model, ["experts.1"])
    assert found == [model.moe.experts[1]] and missing == []
