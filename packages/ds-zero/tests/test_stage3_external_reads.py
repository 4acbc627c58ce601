"""Stage 3 gathers a partitioned parameter that a running forward reads although its module does
not fetch it, and makes it an external parameter of the innermost running module (DeepSpeed's
``ZeROOrderedDict``); lookups outside a forward never gather, and the modules' parameter dicts
copy and pickle as plain dicts. (Training parity: ``ds-engine/tests/test_stage3_external.py``.)"""

from __future__ import annotations

import copy
import dataclasses
import pickle

import torch
from torch import nn

from ds_testing import run_on_ranks


class Tied(nn.Module):
    """The root reads the embedding's weight after the embedding's forward released it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.embed(ids)) @ self.embed.weight.t()


def _stage3(model: nn.Module):
    import ds_zero

    config = ds_zero.ZeroConfig.from_dict(
        {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0}
    )
    return ds_zero.build_zero_optimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), config)


def _body(rank: int, world_size: int) -> bool:
    from ds_zero import ZeroParamStatus

    torch.manual_seed(0)
    model = Tied()
    reference = copy.deepcopy(model)
    optimizer = _stage3(model)
    ids = torch.tensor([[1, 2, 3]])
    # outside a forward: the lookup hands out the partitioned parameter as it is
    assert model.embed.weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
    assert model.embed.weight.numel() == 0
    for step in range(3):
        out = model(ids)
        torch.testing.assert_close(out, reference(ids), msg=f"step {step}")
        # registered with the root, whose forward read it, and released after that forward
        assert any(p is model.embed.weight for p in model._ds_external_params)
        assert model.embed.weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
        optimizer.backward(out.sum())
        optimizer.step()
        reference(ids).sum().backward()
        with torch.no_grad():
            for p in reference.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    assert len(model._ds_external_params) == 1
    # copies and pickles carry plain dicts
    params = model.embed._parameters
    assert params.__reduce_ex__(pickle.HIGHEST_PROTOCOL)[0] is dict
    assert type(copy.copy(params)) is dict and type(copy.deepcopy(model)._parameters) is dict
    optimizer.hooks.remove()
    assert all(type(m._parameters) is dict for m in model.modules())
    return True


def test_a_parameter_read_by_another_modules_forward_is_gathered_and_released() -> None:
    assert run_on_ranks(_body, 2) == [True, True]


@dataclasses.dataclass(frozen=True)
class _Routed:
    weights: torch.Tensor
    count: int


class _Gate(nn.Module):
    """ds-moe's gate: reads its projection's weight without calling it, returns a dataclass."""

    def __init__(self) -> None:
        super().__init__()
        self.wg = nn.Linear(4, 3, bias=False)

    def forward(self, x: torch.Tensor) -> _Routed:
        return _Routed(torch.softmax(nn.functional.linear(x, self.wg.weight), -1), 3)


class _Routing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = _Gate()
        self.out = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gate(x).weights)


def _dataclass_body(rank: int, world_size: int) -> float:
    torch.manual_seed(0)
    model = _Routing()
    reference = copy.deepcopy(model)
    optimizer = _stage3(model)
    x = torch.randn(5, 4)
    for _ in range(2):  # the gate's weight is gathered again for the backward
        optimizer.backward(model(x).sum())
        optimizer.step()
        reference(x).sum().backward()
        with torch.no_grad():
            for p in reference.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    with torch.no_grad():
        return (model(x) - reference(x)).abs().max().item()


def test_a_dataclass_output_gathers_its_module_for_backward() -> None:
    assert max(run_on_ranks(_dataclass_body, 2)) < 1e-6
