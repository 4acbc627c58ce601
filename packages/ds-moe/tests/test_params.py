"""Expert vs dense parameters: DeepSpeed's tags and the optimizer param-group split."""

from __future__ import annotations

import torch
from torch import nn

import ds_moe


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 4),
        ds_moe.MoE(4, nn.Linear(4, 4), num_experts=4),
        ds_moe.MoE(4, nn.Linear(4, 4), num_experts=2, use_residual=True),
    )


def _names(model: nn.Module, params: list[nn.Parameter]) -> list[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(p)] for p in params]


def test_split_shared_and_expert_params_keeps_order() -> None:
    model = _model()
    shared, expert = ds_moe.split_params_into_shared_and_expert_params(model.parameters())
    assert _names(model, expert) == [
        n for n, _ in model.named_parameters() if ".deepspeed_experts." in n
    ]
    assert len(shared) + len(expert) == len(list(model.parameters()))
    assert not any(ds_moe.is_moe_param(p) for p in shared)


def test_split_grads_only_takes_params_with_grads() -> None:
    model = _model()
    out, _, _ = model[1](model[0](torch.randn(6, 4)))
    out.sum().backward()
    shared, expert = ds_moe.split_params_grads_into_shared_and_expert_params(model.parameters())
    assert len(shared) == 3  # model[0] weight/bias and the first gate; the second layer is unused
    assert len(expert) == 2 * 4


def test_optimizer_groups_split_by_expert_group_name() -> None:
    model = _model()
    source = {"params": list(model.parameters()), "name": "dense", "lr": 0.1, "weight_decay": 0.0}
    before = dict(source)

    groups = ds_moe.split_params_into_different_moe_groups_for_optimizer(source)

    assert source == before  # input dict untouched
    dense, moe = groups[0], groups[1:]
    assert dense["name"] == "dense" and not ds_moe.is_moe_param_group(dense)
    assert not any(ds_moe.is_moe_param(p) for p in dense["params"])
    assert [g["name"] for g in moe] == ["ep_size_1"]
    assert moe[0]["moe"] and ds_moe.is_moe_param_group(moe[0])
    assert moe[0]["lr"] == 0.1 and moe[0]["weight_decay"] == 0.0
    assert len(moe[0]["params"]) == 2 * (4 + 2)
    optimizer = torch.optim.SGD(groups)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))


def test_expert_groups_are_chunked_by_max_group_size() -> None:
    model = _model()
    groups = ds_moe.split_params_into_different_moe_groups_for_optimizer(
        [{"params": list(model.parameters()), "name": "a"}], max_group_size=30
    )
    chunks = [g["params"] for g in groups if ds_moe.is_moe_param_group(g)]
    # Each expert is a 4x4 weight and a bias: 20 elements, so a second one would pass 30.
    assert [sum(p.numel() for p in c) for c in chunks] == [20] * 6
    assert all(len(c) == 2 for c in chunks)


def test_several_input_groups_each_get_their_expert_group() -> None:
    model = _model()
    first, second = model[1], model[2]
    groups = ds_moe.split_params_into_different_moe_groups_for_optimizer(
        (
            {"params": list(first.parameters()), "name": "first", "lr": 1.0},
            {"params": list(second.parameters()), "name": "second", "lr": 2.0},
        ),
        max_group_size=None,
    )
    assert [(g["name"], g.get("moe", False), g["lr"]) for g in groups] == [
        ("first", False, 1.0),
        ("second", False, 2.0),
        ("ep_size_1", True, 1.0),
        ("ep_size_1", True, 2.0),
    ]
