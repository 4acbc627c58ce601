"""GatheredParameters: whole values inside the context, writes on ``modifier_rank`` re-partitioned
on exit, nesting, pass-through of plain parameters; external parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_testing import run_on_ranks
from ds_zero import (
    GatheredParameters,
    ParamPartitioner,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)


def _partitioned(threshold: int = 0) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A small model partitioned over the default group (values equal on every rank)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    ParamPartitioner(persistence_threshold=threshold).partition(
        model.parameters(), names=list(reference)
    )
    return model, reference


def _shard_of(whole: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    s = -(-whole.numel() // world)
    flat = torch.zeros(s * world, dtype=whole.dtype)
    flat[: whole.numel()] = whole.reshape(-1)
    return flat[rank * s : (rank + 1) * s]


def _gather_read_body(rank: int, world_size: int) -> None:
    model, reference = _partitioned()
    params = dict(model.named_parameters())
    assert all(p.numel() == 0 for p in params.values())
    with GatheredParameters(model.parameters()):
        for name, p in params.items():
            assert p.ds_status is ZeroParamStatus.AVAILABLE
            torch.testing.assert_close(p.data, reference[name], rtol=0, atol=0)
        x = torch.ones(2, 5)
        expected = x @ reference["0.weight"].T + reference["0.bias"]
        torch.testing.assert_close(model[0](x), expected)
    assert all(
        p.numel() == 0 and p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in params.values()
    )
    # Without modifier_rank, writes are discarded.
    with GatheredParameters(params["1.weight"]):
        params["1.weight"].data.fill_(123.0)
    with GatheredParameters(params["1.weight"]):
        torch.testing.assert_close(params["1.weight"].data, reference["1.weight"])


def _modifier_body(rank: int, world_size: int, modifier: int) -> None:
    model, reference = _partitioned()
    weight, bias = model[0].weight, model[0].bias
    with GatheredParameters([weight, bias], modifier_rank=modifier), torch.no_grad():
        weight.fill_(float(rank + 1))  # every rank writes; only the modifier's are kept
        bias.copy_(torch.arange(7.0) * (rank + 1))
    assert weight.numel() == 0 and bias.numel() == 0
    kept = {
        "0.weight": torch.full((7, 5), float(modifier + 1)),
        "0.bias": torch.arange(7.0) * (modifier + 1),
    }
    for name, p in (("0.weight", weight), ("0.bias", bias)):
        torch.testing.assert_close(p.ds_tensor, _shard_of(kept[name], rank, world_size))
    with GatheredParameters(model.parameters()):
        torch.testing.assert_close(weight.data, kept["0.weight"])
        torch.testing.assert_close(model[1].weight.data, reference["1.weight"])  # untouched


def _nested_body(rank: int, world_size: int) -> None:
    model, _ = _partitioned()
    a, b = model[0].weight, model[1].weight
    with GatheredParameters([a, b]):
        with GatheredParameters(a, modifier_rank=0), torch.no_grad():
            a.mul_(2.0)
        assert a.ds_status is ZeroParamStatus.AVAILABLE and a.numel() == 35  # outer holds it
        assert b.ds_status is ZeroParamStatus.AVAILABLE
        doubled = a.data.clone()
    assert a.numel() == 0 and b.numel() == 0
    with GatheredParameters(a):
        torch.testing.assert_close(a.data, doubled)


def _persistent_and_plain_body(rank: int, world_size: int) -> None:
    model, reference = _partitioned(threshold=10)  # both biases (7 and 3 elements) stay whole
    bias = model[0].bias
    plain = nn.Parameter(torch.ones(4))
    assert bias.ds_persist and bias.numel() == 7
    with GatheredParameters([bias, plain], modifier_rank=world_size - 1), torch.no_grad():
        bias.add_(rank)
        plain.add_(rank)  # not partitioned: passes through, nothing broadcast
    torch.testing.assert_close(bias.data, reference["0.bias"] + world_size - 1)
    torch.testing.assert_close(bias.ds_tensor, _shard_of(bias.data, rank, world_size))
    torch.testing.assert_close(plain.data, torch.ones(4) + rank)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_gathered_parameters_read_whole_values(world_size: int) -> None:
    run_on_ranks(_gather_read_body, world_size)


@pytest.mark.parametrize("world_size, modifier", [(1, 0), (2, 1), (4, 2)])
def test_writes_on_modifier_rank_are_repartitioned(world_size: int, modifier: int) -> None:
    run_on_ranks(_modifier_body, world_size, modifier=modifier)


@pytest.mark.parametrize("world_size", [2])
def test_nested_contexts_release_only_what_they_gathered(world_size: int) -> None:
    run_on_ranks(_nested_body, world_size)


@pytest.mark.parametrize("world_size", [1, 2])
def test_persistent_params_update_and_plain_params_pass_through(world_size: int) -> None:
    run_on_ranks(_persistent_and_plain_body, world_size)


def test_disabled_context_and_bad_modifier_rank() -> None:
    model, _ = _partitioned()
    with GatheredParameters(model.parameters(), enabled=False):
        assert model[0].weight.numel() == 0
    with (
        pytest.raises(ValueError, match="modifier_rank = 3"),
        GatheredParameters(model[0].weight, modifier_rank=3),
    ):
        pass
    assert model[0].weight.numel() == 0  # released even though the exit failed


def test_external_parameters() -> None:
    model, _ = _partitioned()
    head, shared = model[1], model[0].weight
    register_external_parameter(head, shared)
    register_external_parameter(head, shared)  # once only
    assert head._ds_external_params == [shared]
    unregister_external_parameter(head, shared)
    assert head._ds_external_params == []
    with pytest.raises(ValueError, match="not an external parameter of Linear"):
        unregister_external_parameter(head, shared)
    with pytest.raises(TypeError, match=r"torch\.nn\.Parameter"):
        register_external_parameter(head, torch.ones(2))  # type: ignore[arg-type]
    with GatheredParameters(shared, fwd_module=head):
        assert shared.numel() == 35
    assert head._ds_external_params == [shared]
