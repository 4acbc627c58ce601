"""Partition methods: uniform, balanced (optimal bottleneck, checked by brute force), parameter
counts on the meta device, type regexes, explicit boundaries, errors and the printed table."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

from ds_pipe import (
    LayerSpec,
    TiedLayerSpec,
    count_layer_params,
    format_partition,
    partition_balanced,
    partition_layers,
    partition_uniform,
)


def _sizes(parts: list[int]) -> list[int]:
    return [b - a for a, b in itertools.pairwise(parts)]


@pytest.mark.parametrize(("items", "num_parts"), [(7, 3), (8, 4), (5, 5), (9, 2), (1, 1)])
def test_uniform_sizes_differ_by_at_most_one_extras_first(items: int, num_parts: int) -> None:
    parts = partition_uniform(items, num_parts)
    sizes = _sizes(parts)
    assert parts[0] == 0 and parts[-1] == items and len(sizes) == num_parts
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def _brute_force_bottleneck(weights: list[int], num_parts: int) -> int:
    best = None
    for cuts in itertools.combinations(range(1, len(weights)), num_parts - 1):
        bounds = [0, *cuts, len(weights)]
        worst = max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


def test_balanced_reaches_the_optimal_bottleneck_on_random_weights() -> None:
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 9)
        num_parts = rng.randint(1, n)
        weights = [rng.choice([0, 0, 1, 2, 5, 13, 100]) for _ in range(n)]
        parts = partition_balanced(weights, num_parts)
        sizes = _sizes(parts)
        assert parts[0] == 0 and parts[-1] == n and len(sizes) == num_parts
        assert min(sizes) >= 1, (weights, parts)
        worst = max(sum(weights[a:b]) for a, b in itertools.pairwise(parts))
        assert worst == _brute_force_bottleneck(weights, num_parts), (weights, parts)


def test_balanced_spreads_slack_instead_of_starving_the_last_part() -> None:
    assert partition_balanced([1] * 7, 3) == [0, 2, 5, 7]
    assert partition_balanced([4, 1, 1, 1, 1], 2) == [0, 1, 5]
    assert partition_balanced([0, 1, 1, 1, 1, 0, 0], 2) == [0, 3, 7]


def test_balanced_rejects_negative_weights() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        partition_balanced([1, -1, 2], 2)


class Recorder(nn.Module):
    """Records the device type of every weight it allocates."""

    devices: list[str] = []

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        Recorder.devices.append(self.linear.weight.device.type)


def test_parameter_counts_use_the_meta_device_and_leave_the_rng_alone() -> None:
    Recorder.devices = []
    state = torch.random.get_rng_state()
    assert count_layer_params(LayerSpec(Recorder, 64)) == 64 * 64 + 64
    assert Recorder.devices == ["meta"]
    assert torch.equal(state, torch.random.get_rng_state())
    frozen = nn.Linear(3, 3)
    frozen.bias.requires_grad_(False)
    assert count_layer_params(frozen) == 9  # trainable only
    assert count_layer_params(torch.relu) == 0


class NeedsValues(nn.Module):
    """A constructor that reads tensor values (cannot run on meta)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(5))
        assert float(self.weight.sum().item()) == 5.0


def test_parameter_count_falls_back_to_a_real_build() -> None:
    assert count_layer_params(LayerSpec(NeedsValues)) == 5


def _layers() -> list[object]:
    return [
        TiedLayerSpec("embed", nn.Embedding, 50, 8),  # 400
        LayerSpec(nn.Linear, 8, 8),  # 72
        LayerSpec(nn.Linear, 8, 8),
        torch.tanh,
        LayerSpec(nn.TransformerEncoderLayer, 8, 2, 16),
        LayerSpec(nn.TransformerEncoderLayer, 8, 2, 16),
        LayerSpec(nn.LayerNorm, 8),  # 16
    ]


def test_partition_methods() -> None:
    layers = _layers()
    assert partition_layers(layers, 2, "uniform") == [0, 4, 7]
    # parameters: [400, 72, 72, 0, 600, 600, 16]: 1144 | 616 beats 544 | 1216
    counts = [count_layer_params(layer) for layer in layers]
    assert counts == [400, 72, 72, 0, 600, 600, 16]
    assert partition_layers(layers, 2, "parameters") == [0, 5, 7]
    parts3 = partition_layers(layers, 3, "parameters")
    assert max(sum(counts[a:b]) for a, b in itertools.pairwise(parts3)) == _brute_force_bottleneck(
        counts, 3
    )
    # type: one encoder layer per stage, matched case-insensitively
    assert partition_layers(layers, 2, "type:transformerencoder") == [0, 5, 7]
    assert partition_layers(layers, 2, "type:^LINEAR$") == [0, 2, 7]
    assert partition_layers(layers, 2, [0, 1, 7]) == [0, 1, 7]
    # all-zero weights (only callables) fall back to uniform
    assert partition_layers([torch.tanh] * 4, 2, "parameters") == [0, 2, 4]


@pytest.mark.parametrize(
    ("method", "message"),
    [
        ("profile", "'profile' is not supported; use 'parameters', 'uniform'"),
        ("type:(", "is not a valid regex"),
        ("type:conv", r"matches no layer class; the classes are \['Embedding', 'LayerNorm'"),
        ([0, 3, 3, 7], "give 3 strictly increasing integers from 0 to 7"),
        ([0, 3, 6], "from 0 to 7"),
        ([1, 3, 7], "e.g. \\[0, 4, 7\\]"),
    ],
)
def test_partition_errors_name_the_value_and_the_fix(method: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        partition_layers(_layers(), 2, method)  # type: ignore[arg-type]


def test_more_parts_than_layers_is_an_error() -> None:
    with pytest.raises(ValueError, match="3 layers cannot fill 4 pipeline parts"):
        partition_layers([torch.tanh] * 3, 4, "uniform")


def test_format_partition_is_one_table() -> None:
    layers = _layers()
    text = format_partition(layers, [0, 4, 7], 2, "parameters", nn.MSELoss())
    lines = text.splitlines()
    assert lines[0].startswith("Pipeline partition: 7 layers on 2 stages, method='parameters'")
    assert lines[1].split() == ["stage", "chunk", "layer", "params", "spec"]
    assert lines[2].split()[:4] == ["0", "0", "0", "400"]
    assert lines[5].split()[:3] == ["0", "0", "3"] and "callable tanh" in lines[5]
    assert lines[6].split()[:3] == ["1", "1", "4"]
    assert lines[-1] == "loss: MSELoss"
    virtual = format_partition(layers, [0, 2, 4, 5, 7], 2, "uniform")
    assert "x 2 virtual stages" in virtual.splitlines()[0]
    assert virtual.splitlines()[6].split()[:3] == ["0", "2", "4"]  # chunk 2 lives on stage 0
