"""Top-1/top-2 gating (Switch/GShard, DeepSpeed's ``TopKGate``): which expert slot each token
takes, its weight, the load-balancing loss and the per-expert counts.

[Note: routing semantics]
DeepSpeed's ``top1gating``/``top2gating``, expressed without the ``[tokens, E, C]`` one-hot
tensors (see [Note: MoE routing as index maps] in ``ds_kernels/_moe_dispatch.py``):

* ``gates = softmax(logits)`` in float32. The first expert is ``argmax(gates)``, or with
  ``RSample`` (training) ``argmax(logits + Gumbel)``. The second (k=2) is the argmax of the
  logits without the first, plus Gumbel noise when ``top2_2nd_expert_sampling`` (training).
* ``exp_counts[e]``: choices of expert ``e`` over the tokens in use (``used_token``), before
  capacity drops. ``l_aux = E * sum_e mean_s(gates[s, e]) * fraction of first choices to e``.
* Capacity (``drop_tokens``): ``max(ceil(k * S / E * capacity_factor), min_capacity)``, computed
  in float32 as DeepSpeed does (see [Note: capacity in float32]); without ``drop_tokens``, the
  largest ``exp_counts`` over the expert-parallel group, so every rank sizes its buffers alike
  and no token is dropped.
* Priority within an expert: k=1 keeps the first tokens in order, or with ``use_rts`` (training)
  a uniformly random subset (DeepSpeed's Random Token Selection: top-``capacity`` of a uniform
  draw); kept
  tokens take positions in token order. k=2 ranks all first choices (in token order) before all
  second choices, so a second choice only gets what first choices left.
* Weights: k=1 ``gates[s, e]``; k=2 both choices' gates renormalised over the kept ones
  (``g1 / max(g1 + g2, eps)``), so a token whose second choice was dropped gets weight 1 on its
  first. A dropped choice has weight 0 and no slot.

One deliberate difference: DeepSpeed also samples the k=2 second expert and draws the RTS
priorities in eval mode, which makes evaluation random; here both are training-time policies,
like ``Jitter`` and ``RSample``, and eval routing is deterministic.

[Note: capacity in float32]
DeepSpeed computes ``ceil((S / E) * capacity_factor)`` with ``capacity_factor`` a float32
tensor, so the product is rounded to float32 before the ceiling (``S=10, E=3, factor 1.2``
gives 4 in float32 and 4 in float64, but other inputs differ at the boundary). The same
rounding is applied here so capacities match DeepSpeed's exactly.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ds_comm
from ds_moe.api import GateConfig, Routing

__all__ = ["TopKGate", "capacity", "route"]

_JITTER_EPSILON = 1e-2


def capacity(
    num_tokens: int, num_experts: int, *, k: int, capacity_factor: float, min_capacity: int
) -> int:
    """Slots per expert when dropping tokens; see [Note: capacity in float32].

    Example:
        >>> capacity(64, 8, k=2, capacity_factor=1.0, min_capacity=4)
        16
    """
    per_expert = torch.tensor(num_tokens / num_experts, dtype=torch.float32)
    factor = torch.tensor(capacity_factor * k, dtype=torch.float32)
    return max(math.ceil(float(per_expert * factor)), min_capacity)


def _gumbel_like(t: torch.Tensor) -> torch.Tensor:
    # -log(Exp(1)) is Gumbel(0, 1).
    return -torch.empty_like(t).exponential_().log()


def _count(ids: torch.Tensor, size: int) -> torch.Tensor:
    """Occurrences of each id in ``[0, size)``; sync-free (``bincount`` reads the max on GPU)."""
    return torch.zeros(size, dtype=torch.int64, device=ids.device).scatter_add_(
        0, ids, torch.ones_like(ids)
    )


def _count_routed(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Choices of each expert; unrouted ones (``-1``) are counted in an extra bin cut off."""
    return _count(torch.where(experts >= 0, experts, num_experts), num_experts + 1)[:-1]


def _rank_within_expert(expert: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Each element's position among the elements of the same expert, in the given order.

    ``expert`` holds expert ids or ``-1`` (not routed; its position is meaningless). A stable sort
    by expert keeps the given order within each expert: ``O(n log n)``, independent of E.
    """
    bucket = torch.where(expert < 0, num_experts, expert)
    order = torch.argsort(bucket, stable=True)
    counts = _count(bucket, num_experts + 1)
    starts = torch.cumsum(counts, 0) - counts
    sorted_rank = torch.arange(expert.numel(), device=expert.device) - starts[bucket[order]]
    return torch.empty_like(sorted_rank).scatter_(0, order, sorted_rank)


def _choose_experts(
    logits: torch.Tensor, gates: torch.Tensor, config: GateConfig, training: bool
) -> torch.Tensor:
    """``[k, S]`` expert ids: first choices, then second choices."""
    noisy = training and config.noisy_gate_policy == "RSample"
    first = torch.argmax(logits + _gumbel_like(logits) if noisy else gates, dim=1)
    if config.k == 1:
        return first.unsqueeze(0)
    scores = logits
    if training and config.top2_2nd_expert_sampling:
        scores = logits + _gumbel_like(logits)
    scores = scores.masked_fill(F.one_hot(first, logits.size(1)).bool(), float("-inf"))
    return torch.stack([first, torch.argmax(scores, dim=1)])


def _no_drop_capacity(exp_counts: torch.Tensor, ep_group: Any) -> int:
    largest = exp_counts.max() if exp_counts.numel() else exp_counts.new_zeros(())
    if ep_group is not None and ds_comm.get_world_size(ep_group) > 1:
        largest = largest.clone()
        ds_comm.all_reduce(largest, op=ds_comm.ReduceOp.MAX, group=ep_group)
    return int(largest)


def _positions(
    experts: torch.Tensor, capacity: int, num_experts: int, use_rts: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kept, position)`` of each flattened choice (``[k * S]``, choice-major)."""
    if not use_rts:
        position = _rank_within_expert(experts, num_experts)
        return (experts >= 0) & (position < capacity), position
    # Random Token Selection: rank by a uniform priority, keep the top `capacity` per expert,
    # then lay the kept tokens out in token order.
    order = torch.argsort(torch.rand(experts.shape, device=experts.device), descending=True)
    by_priority = torch.empty_like(experts).scatter_(
        0, order, _rank_within_expert(experts[order], num_experts)
    )
    kept = (experts >= 0) & (by_priority < capacity)
    position = _rank_within_expert(torch.where(kept, experts, -1), num_experts)
    return kept, position


def route(
    logits: torch.Tensor,
    config: GateConfig,
    *,
    training: bool,
    used_token: torch.Tensor | None = None,
    ep_group: Any = None,
) -> Routing:
    """Routes ``[tokens, num_experts]`` float32 gate logits; see [Note: routing semantics].

    Args:
        logits: the gate's logits.
        config: the gate's policy.
        training: apply the training capacity factor and noise policies.
        used_token: optional ``[tokens]`` mask; tokens where it is 0 are not routed.
        ep_group: expert-parallel group, only used without ``drop_tokens`` (capacity agreement).

    Returns:
        The routing of every token.
    """
    num_tokens, num_experts = logits.shape
    k = config.k
    gates = F.softmax(logits, dim=1)
    experts = _choose_experts(logits, gates, config, training)
    if used_token is not None:
        experts = experts.masked_fill(used_token.reshape(1, -1) == 0, -1)
    flat = experts.reshape(-1)
    exp_counts = _count_routed(flat, num_experts)
    first_share = _count_routed(experts[0], num_experts)
    me = gates.mean(dim=0)
    ce = first_share.to(gates.dtype) / max(num_tokens, 1)
    l_aux = torch.sum(me * ce) * num_experts

    factor = config.capacity_factor if training else config.eval_capacity_factor
    if config.drop_tokens:
        slots = capacity(
            num_tokens, num_experts, k=k, capacity_factor=factor, min_capacity=config.min_capacity
        )
    else:
        slots = _no_drop_capacity(exp_counts, ep_group)
    use_rts = config.use_rts and k == 1 and config.drop_tokens and training
    kept, position = _positions(flat, slots, num_experts, use_rts)

    token_slot = torch.where(kept, flat * slots + position, -1).view(k, num_tokens).t()
    kept = kept.view(k, num_tokens).t()
    weight = gates.gather(1, experts.t().clamp(min=0)) * kept
    if k == 2:
        denom = weight.sum(dim=1, keepdim=True).clamp(min=torch.finfo(weight.dtype).eps)
        weight = weight / denom
    token_slot = token_slot.contiguous()
    # Dropped choices write to one extra slot that is cut off (no boolean indexing: no GPU sync).
    num_slots = num_experts * slots
    target = torch.where(token_slot >= 0, token_slot, num_slots).view(-1)
    choice = torch.arange(num_tokens * k, device=logits.device)
    slot_source = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=logits.device)
    slot_source = slot_source.scatter_(0, target, choice)[:-1]
    slot_token = torch.where(slot_source >= 0, slot_source // k, -1)
    return Routing(
        num_experts=num_experts,
        capacity=slots,
        token_slot=token_slot,
        combine_weight=weight,
        slot_token=slot_token,
        slot_source=slot_source,
        l_aux=l_aux,
        exp_counts=exp_counts,
    )


class TopKGate(nn.Module):
    """Top-1/top-2 gate (DeepSpeed's ``TopKGate``): a bias-free float32 linear layer and
    :func:`route`.

    Args:
        model_dim: hidden size of the tokens.
        num_experts: experts to route over.
        k, capacity_factor, eval_capacity_factor, min_capacity, noisy_gate_policy, drop_tokens,
            use_rts, top2_2nd_expert_sampling: see :class:`~ds_moe.GateConfig`.
        ep_group: the expert-parallel process group (needed without ``drop_tokens``).

    Example:
        >>> gate = TopKGate(16, num_experts=4, k=2)
        >>> routing = gate(torch.randn(32, 16))
        >>> routing.token_slot.shape, routing.exp_counts.sum().item()
        (torch.Size([32, 2]), 64)
    """

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        ep_group: Any = None,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        self.config = GateConfig(
            k=k,
            capacity_factor=capacity_factor,
            eval_capacity_factor=eval_capacity_factor,
            min_capacity=min_capacity,
            noisy_gate_policy=noisy_gate_policy,  # type: ignore[arg-type]
            drop_tokens=drop_tokens,
            use_rts=use_rts,
            top2_2nd_expert_sampling=top2_2nd_expert_sampling,
        )
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group

    def forward(self, input: torch.Tensor, used_token: torch.Tensor | None = None) -> Routing:
        """Routes ``[tokens, model_dim]`` tokens; the gate always computes in float32."""
        x = input.float()
        if self.training and self.config.noisy_gate_policy == "Jitter":
            x = x * torch.empty_like(x).uniform_(1.0 - _JITTER_EPSILON, 1.0 + _JITTER_EPSILON)
        logits = F.linear(x, self.wg.weight.float())
        return route(
            logits,
            self.config,
            training=self.training,
            used_token=used_token,
            ep_group=self.ep_group,
        )
