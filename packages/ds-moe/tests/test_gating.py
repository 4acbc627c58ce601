"""Top-1/top-2 gating: capacity, dropping and slots counted exactly on crafted logits, Random
Token Selection, the k=2 second-expert policy, noise policies, and agreement with DeepSpeed's
one-hot/cumsum formulation on random logits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import ds_moe
from ds_comm import ConfigError
from ds_moe import GateConfig, route


def _logits_for(
    experts: list[int], num_experts: int, second: list[int] | None = None
) -> torch.Tensor:
    """Logits whose top choice for token s is ``experts[s]`` (and second ``second[s]``)."""
    logits = torch.zeros(len(experts), num_experts)
    logits[torch.arange(len(experts)), torch.tensor(experts)] = 4.0
    if second is not None:
        logits[torch.arange(len(second)), torch.tensor(second)] = 2.0
    return logits


@pytest.mark.parametrize(
    ("tokens", "experts", "k", "factor", "min_capacity"),
    [
        (64, 8, 1, 1.0, 4),
        (64, 8, 2, 1.0, 4),
        (10, 3, 1, 1.2, 0),
        (7, 3, 2, 1.1, 0),
        (8, 8, 1, 1.0, 4),
    ],
)
def test_capacity_is_deepspeed_float32_formula(
    tokens: int, experts: int, k: int, factor: float, min_capacity: int
) -> None:
    float32 = np.float32(tokens / experts) * np.float32(factor * k)
    expected = max(math.ceil(float(float32)), min_capacity)
    got = ds_moe.capacity(tokens, experts, k=k, capacity_factor=factor, min_capacity=min_capacity)
    assert got == expected


def test_top1_first_come_drops_exactly() -> None:
    # 8 tokens, 4 experts, capacity ceil(8 / 4 * 1.0) = 2: expert 0 gets 5 tokens and keeps 2.
    logits = _logits_for([0, 0, 0, 1, 0, 2, 0, 1], 4)
    config = GateConfig(use_rts=False, min_capacity=0)

    routing = route(logits, config, training=True)

    assert routing.capacity == 2
    assert routing.exp_counts.tolist() == [5, 2, 1, 0]
    # slot = expert * capacity + position; -1 = dropped
    assert routing.token_slot[:, 0].tolist() == [0, 1, -1, 2, -1, 4, -1, 3]
    assert routing.slot_token.tolist() == [0, 1, 3, 7, 5, -1, -1, -1]
    kept = routing.token_slot[:, 0] >= 0
    assert torch.all(routing.combine_weight[~kept] == 0)
    gates = F.softmax(logits, dim=1)
    expected_weight = gates[torch.arange(8), logits.argmax(1)] * kept
    torch.testing.assert_close(routing.combine_weight[:, 0], expected_weight)


def test_min_capacity_floors_capacity() -> None:
    routing = route(
        _logits_for([0] * 8, 4), GateConfig(use_rts=False, min_capacity=6), training=True
    )
    assert routing.capacity == 6
    assert int((routing.token_slot >= 0).sum()) == 6


def test_eval_uses_eval_capacity_factor() -> None:
    logits = _logits_for([0] * 8, 4)
    config = GateConfig(capacity_factor=1.0, eval_capacity_factor=4.0, min_capacity=0)
    assert route(logits, config, training=True).capacity == 2
    routing = route(logits, config, training=False)
    assert routing.capacity == 8 and bool(torch.all(routing.token_slot >= 0))


def test_rts_keeps_a_random_subset_laid_out_in_token_order() -> None:
    logits = _logits_for([0] * 40 + [1] * 3, 4)  # capacity ceil(43 / 4) = 11
    config = GateConfig(min_capacity=0)
    kept_sets = []
    for seed in range(4):
        torch.manual_seed(seed)
        routing = route(logits, config, training=True)
        slots = routing.token_slot[:, 0]
        kept = torch.nonzero(slots[:40] >= 0).flatten()
        assert kept.numel() == 11  # exactly capacity
        assert slots[kept].tolist() == list(range(11))  # positions follow token order
        assert slots[40:].tolist() == [11, 12, 13]  # an expert under capacity keeps all
        kept_sets.append(tuple(kept.tolist()))
    assert len(set(kept_sets)) > 1  # random, not the first 11
    torch.manual_seed(0)
    again = route(logits, config, training=True).token_slot[:, 0]
    assert tuple(torch.nonzero(again[:40] >= 0).flatten().tolist()) == kept_sets[0]


def test_top2_first_choices_take_priority_and_weights_renormalise() -> None:
    # capacity ceil(2 * 4 / 4 * 1.0) = 2. First choices: all expert 0 -> tokens 0, 1 kept.
    # Second choices: expert 1 for tokens 0-2 (token 2 over capacity), expert 2 for token 3.
    logits = _logits_for([0, 0, 0, 0], 4, second=[1, 1, 1, 2])
    config = GateConfig(k=2, min_capacity=0, top2_2nd_expert_sampling=False)

    routing = route(logits, config, training=True)

    assert routing.capacity == 2
    assert routing.exp_counts.tolist() == [4, 3, 1, 0]
    assert routing.token_slot.tolist() == [[0, 2], [1, 3], [-1, -1], [-1, 4]]
    gates = F.softmax(logits, dim=1)
    g1, g2 = gates[0, 0], gates[0, 1]
    weights = routing.combine_weight
    torch.testing.assert_close(weights[0], torch.stack([g1, g2]) / (g1 + g2))
    assert weights[2].tolist() == [0.0, 0.0]
    torch.testing.assert_close(weights[3], torch.tensor([0.0, 1.0]))  # only its second kept


def test_top2_second_expert_is_runner_up_without_sampling_and_in_eval() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 6, generator=gen)
    runner_up = logits.topk(2, dim=1).indices[:, 1]
    for config, training in [
        (GateConfig(k=2, top2_2nd_expert_sampling=False, drop_tokens=False), True),
        (GateConfig(k=2, drop_tokens=False), False),  # sampling is a training-time policy
    ]:
        routing = route(logits, config, training=training)
        second = routing.token_slot[:, 1] // routing.capacity
        assert torch.equal(second, runner_up)


def test_top2_second_expert_sampling_is_gumbel_max() -> None:
    # Gumbel-max: the second expert is drawn from softmax over the logits without the first.
    tokens = 20000
    row = torch.tensor([3.0, 1.0, 0.5, 0.0, -1.0])
    config = GateConfig(k=2, drop_tokens=False)
    torch.manual_seed(0)
    routing = route(row.expand(tokens, -1).clone(), config, training=True)
    second = routing.token_slot[:, 1] // routing.capacity
    assert not torch.any(second == 0)
    observed = torch.bincount(second, minlength=5).float() / tokens
    expected = torch.cat([torch.zeros(1), F.softmax(row[1:], dim=0)])
    torch.testing.assert_close(observed, expected, atol=0.015, rtol=0)


def test_rsample_first_choice_is_gumbel_max_in_training_only() -> None:
    tokens = 20000
    row = torch.tensor([1.0, 0.5, 0.0, -0.5])
    config = GateConfig(noisy_gate_policy="RSample", drop_tokens=False)
    torch.manual_seed(0)
    logits = row.expand(tokens, -1).clone()
    routing = route(logits, config, training=True)
    first = routing.token_slot[:, 0] // routing.capacity
    observed = torch.bincount(first, minlength=4).float() / tokens
    torch.testing.assert_close(observed, F.softmax(row, dim=0), atol=0.015, rtol=0)
    assert torch.all(route(logits, config, training=False).token_slot[:, 0] >= 0)
    eval_first = route(logits, config, training=False).token_slot[:, 0]
    assert torch.all(eval_first // route(logits, config, training=False).capacity == 0)


def test_jitter_perturbs_the_gate_input_in_training_only() -> None:
    torch.manual_seed(0)
    gate = ds_moe.TopKGate(8, 4, noisy_gate_policy="Jitter", drop_tokens=False)
    x = torch.randn(256, 8)

    def experts() -> torch.Tensor:
        routing = gate(x)
        return routing.token_slot[:, 0] // routing.capacity

    gate.eval()
    plain = experts()
    assert torch.equal(experts(), plain)
    gate.train()
    flips = [int((experts() != plain).sum()) for _ in range(4)]
    assert max(flips) > 0  # near-ties flip under the 1% multiplicative noise...
    assert max(flips) < 256 // 8  # ...but most tokens keep their expert


@pytest.mark.parametrize("k", [1, 2])
def test_l_aux_is_load_balancing_loss(k: int) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(32, 4, generator=gen, requires_grad=True)
    routing = route(logits, GateConfig(k=k, use_rts=False), training=True)
    gates = F.softmax(logits.detach(), dim=1)
    first = gates.argmax(dim=1)
    fraction = torch.bincount(first, minlength=4).float() / 32
    expected = 4 * (gates.mean(0) * fraction).sum()
    torch.testing.assert_close(routing.l_aux.detach(), expected)
    routing.l_aux.backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


@pytest.mark.parametrize("k", [1, 2])
def test_used_token_keeps_tokens_out_of_routing(k: int) -> None:
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(10, 4, generator=gen)
    used = torch.tensor([1, 0, 1, 1, 0, 1, 1, 1, 1, 0])
    routing = route(logits, GateConfig(k=k, drop_tokens=False), training=True, used_token=used)
    assert torch.all(routing.token_slot[used == 0] == -1)
    assert torch.all(routing.combine_weight[used == 0] == 0)
    assert int(routing.exp_counts.sum()) == k * int(used.sum())
    held = routing.slot_token[routing.slot_token >= 0]
    assert not torch.isin(held, torch.nonzero(used == 0).flatten()).any()


@pytest.mark.parametrize("k", [1, 2])
def test_no_drop_capacity_is_the_largest_load(k: int) -> None:
    logits = _logits_for([0] * 9 + [1, 2, 3], 4, second=[1] * 9 + [0, 0, 0])
    routing = route(logits, GateConfig(k=k, drop_tokens=False), training=False)
    assert routing.capacity == int(routing.exp_counts.max())
    assert torch.all(routing.token_slot >= 0)


def _deepspeed_routing(
    logits: torch.Tensor, k: int, factor: float, min_capacity: int, drop: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSpeed's one-hot/cumsum/einsum gating (no RTS, no sampling), written independently."""
    tokens, experts = logits.shape
    gates = F.softmax(logits, dim=1)
    mask1 = F.one_hot(gates.argmax(1), experts)
    masks = [mask1]
    if k == 2:
        masks.append(F.one_hot(logits.masked_fill(mask1.bool(), float("-inf")).argmax(1), experts))
    counts = sum(masks)
    exp_counts = counts.sum(0)
    l_aux = (gates.mean(0) * mask1.float().mean(0)).sum() * experts
    locations = [torch.cumsum(masks[0], 0) - 1]
    if k == 2:
        locations.append(torch.cumsum(masks[1], 0) - 1 + masks[0].sum(0, keepdim=True))
    if drop:
        cap = math.ceil(float(np.float32(tokens / experts) * np.float32(factor * k)))
        cap = max(cap, min_capacity)
        masks = [m * (loc < cap) for m, loc in zip(masks, locations)]
    else:
        cap = int(exp_counts.max())
    gate_s = [(gates * m).sum(1) for m in masks]
    if k == 2:
        denom = (gate_s[0] + gate_s[1]).clamp(min=torch.finfo(gates.dtype).eps)
        gate_s = [g / denom for g in gate_s]
    combine = torch.zeros(tokens, experts, cap)
    for g, m, loc in zip(gate_s, masks, locations):
        loc_s = (loc * m).sum(1)
        combine += torch.einsum("se,sc->sec", g.unsqueeze(1) * m, F.one_hot(loc_s, cap).float())
    return combine, l_aux, exp_counts


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize(
    ("factor", "min_capacity", "drop"), [(1.0, 4, True), (0.5, 0, True), (1.0, 4, False)]
)
def test_matches_deepspeed_formulation(
    k: int, factor: float, min_capacity: int, drop: bool
) -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(48, 6, generator=gen)
    config = GateConfig(
        k=k,
        capacity_factor=factor,
        min_capacity=min_capacity,
        drop_tokens=drop,
        use_rts=False,
        top2_2nd_expert_sampling=False,
    )
    routing = route(logits, config, training=True)
    combine, l_aux, exp_counts = _deepspeed_routing(logits, k, factor, min_capacity, drop)
    torch.testing.assert_close(routing.dense_combine_weights(), combine)
    torch.testing.assert_close(routing.l_aux, l_aux)
    assert torch.equal(routing.exp_counts, exp_counts)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"k": 3}, r"moe.k = 3: expected 1 .* or 2"),
        ({"capacity_factor": 0.0}, r"moe.capacity_factor = 0.0: expected a finite number > 0"),
        ({"eval_capacity_factor": float("nan")}, r"moe.eval_capacity_factor = nan"),
        ({"min_capacity": -1}, r"moe.min_capacity = -1: expected an int >= 0"),
        ({"min_capacity": 2.5}, r"moe.min_capacity = 2.5"),
        ({"noisy_gate_policy": "Gumbel"}, r"noisy_gate_policy = 'Gumbel': expected None, 'Jitter'"),
        ({"drop_tokens": "yes"}, r"moe.drop_tokens = 'yes': expected True or False"),
    ],
)
def test_gate_config_errors_name_key_value_and_fix(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        GateConfig(**kwargs)


def test_noisy_gate_policy_string_none_means_none() -> None:
    assert GateConfig(noisy_gate_policy="None").noisy_gate_policy is None  # type: ignore[arg-type]
