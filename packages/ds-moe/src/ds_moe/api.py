"""Public types of ds-moe: the gate's policy, the routing it produces, expert process groups and
the Mixture-of-Students distillation policy."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ds_comm import ConfigError

__all__ = [
    "ExpertGroup",
    "GateConfig",
    "MoSConfig",
    "NoisyGatePolicy",
    "Routing",
]

NoisyGatePolicy = Literal["Jitter", "RSample"]
"""``Jitter``: multiply the gate's input by U(1-0.01, 1+0.01) noise while training (Switch
Transformer). ``RSample``: pick each token's first expert by argmax of logits + Gumbel noise while
training (the gate values used to weigh the outputs stay noise-free)."""

_NOISY_GATE_POLICIES = ("Jitter", "RSample")


def _require_bool(section: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(
            f"{section}.{name} = {value!r}: expected True or False (got {type(value).__name__})"
        )


def _require_number(section: str, name: str, value: object, *, low: float, strict: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= low if strict else value < low):  # type: ignore[operator]
        bound = f"> {low}" if strict else f">= {low}"
        raise ConfigError(f"{section}.{name} = {value!r}: expected a finite number {bound}")


@dataclass(frozen=True, kw_only=True)
class GateConfig:
    """How :class:`~ds_moe.TopKGate` routes tokens (DeepSpeed's ``MoE``/``TopKGate`` arguments).

    Attributes:
        k: experts per token, 1 (Switch) or 2 (GShard).
        capacity_factor: training capacity per expert is
            ``ceil(k * tokens / num_experts * capacity_factor)``, at least ``min_capacity``.
        eval_capacity_factor: the same in eval mode.
        min_capacity: the smallest capacity per expert.
        noisy_gate_policy: ``None``, ``"Jitter"`` or ``"RSample"`` (``"None"`` is read as None);
            applied in training only.
        drop_tokens: drop tokens over capacity; False raises the capacity to the largest
            per-expert load in the expert-parallel group, so no token is dropped.
        use_rts: Random Token Selection (k=1): an over-full expert keeps a uniformly random subset
            of its tokens instead of the first ones.
        top2_2nd_expert_sampling: k=2 picks the second expert by argmax of logits + Gumbel noise
            while training (instead of the second-largest gate value).
    """

    k: int = 1
    capacity_factor: float = 1.0
    eval_capacity_factor: float = 1.0
    min_capacity: int = 4
    noisy_gate_policy: NoisyGatePolicy | None = None
    drop_tokens: bool = True
    use_rts: bool = True
    top2_2nd_expert_sampling: bool = True

    def __post_init__(self) -> None:
        if self.k not in (1, 2) or isinstance(self.k, bool):
            raise ConfigError(f"moe.k = {self.k!r}: expected 1 (top-1 gating) or 2 (top-2 gating)")
        for name in ("capacity_factor", "eval_capacity_factor"):
            _require_number("moe", name, getattr(self, name), low=0.0, strict=True)
        if not isinstance(self.min_capacity, int) or isinstance(self.min_capacity, bool):
            raise ConfigError(f"moe.min_capacity = {self.min_capacity!r}: expected an int >= 0")
        if self.min_capacity < 0:
            raise ConfigError(f"moe.min_capacity = {self.min_capacity!r}: expected an int >= 0")
        policy = self.noisy_gate_policy
        if policy == "None":
            object.__setattr__(self, "noisy_gate_policy", None)
        elif policy is not None and policy not in _NOISY_GATE_POLICIES:
            raise ConfigError(
                f"moe.noisy_gate_policy = {policy!r}: expected None, 'Jitter' or 'RSample'"
            )
        for name in ("drop_tokens", "use_rts", "top2_2nd_expert_sampling"):
            _require_bool("moe", name, getattr(self, name))


@dataclass(frozen=True, kw_only=True)
class MoSConfig:
    """Mixture-of-Students staged knowledge distillation (Megatron-DeepSpeed's ``--kd-*`` names).

    The student's loss is ``kd_alpha_ce * task_loss + kd_beta_ce * kd_loss`` where ``kd_loss`` is
    ``kd_temp**2 * KL(teacher || student)`` on temperature-softened distributions, averaged over
    tokens. From step ``kd_stop_step`` on (staged KD) the loss is ``task_loss`` alone.

    Attributes:
        kd_alpha_ce: weight of the student's own task loss while distilling.
        kd_beta_ce: weight of the distillation loss.
        kd_temp: softmax temperature applied to both teacher and student logits.
        kd_stop_step: first step without distillation; None distils for the whole run.
    """

    kd_alpha_ce: float = 1.0
    kd_beta_ce: float = 1.0
    kd_temp: float = 1.0
    kd_stop_step: int | None = None

    def __post_init__(self) -> None:
        _require_number("mos", "kd_alpha_ce", self.kd_alpha_ce, low=0.0, strict=False)
        _require_number("mos", "kd_beta_ce", self.kd_beta_ce, low=0.0, strict=False)
        _require_number("mos", "kd_temp", self.kd_temp, low=0.0, strict=True)
        stop = self.kd_stop_step
        if stop is not None and (not isinstance(stop, int) or isinstance(stop, bool) or stop < 0):
            raise ConfigError(
                f"mos.kd_stop_step = {stop!r}: expected None (always distil) or a step >= 0"
            )


@dataclass(frozen=True, kw_only=True, eq=False)
class Routing:
    """Where a gate sent each token: index maps into the ``[num_experts * capacity]`` slots.

    See [Note: MoE routing as index maps] in ``ds_kernels/_moe_dispatch.py``. Slot
    ``e * capacity + c`` is position ``c`` of expert ``e``'s buffer.

    Attributes:
        num_experts: experts (over the whole expert-parallel group).
        capacity: slots per expert.
        token_slot: ``[tokens, k]`` int64 slot of each token's j-th choice, ``-1`` when dropped.
        combine_weight: ``[tokens, k]`` float32 gate weight of each choice (0 when dropped),
            differentiable with respect to the gate.
        slot_token: ``[num_experts * capacity]`` int64 token held by each slot, ``-1`` if empty.
        slot_source: ``[num_experts * capacity]`` int64 ``token * k + j`` of the choice held by
            each slot, ``-1`` if empty.
        l_aux: the load-balancing loss (a differentiable scalar).
        exp_counts: ``[num_experts]`` int64 tokens routed to each expert before capacity drops,
            on the device of the tokens.
    """

    num_experts: int
    capacity: int
    token_slot: torch.Tensor
    combine_weight: torch.Tensor
    slot_token: torch.Tensor
    slot_source: torch.Tensor
    l_aux: torch.Tensor
    exp_counts: torch.Tensor

    @property
    def k(self) -> int:
        """Choices per token."""
        return self.token_slot.size(1)

    def dense_combine_weights(self) -> torch.Tensor:
        """DeepSpeed's ``combine_weights``: a ``[tokens, num_experts, capacity]`` float32 tensor.

        Materialises the one-hot form (``dispatch_mask`` is ``dense_combine_weights() > 0``) for
        inspection and tests; the layer itself never builds it.
        """
        tokens, k = self.token_slot.shape
        dense = self.combine_weight.new_zeros(tokens, self.num_experts * self.capacity)
        kept = self.token_slot >= 0
        rows = torch.arange(tokens, device=dense.device).unsqueeze(1).expand(tokens, k)
        dense.index_put_(
            (rows[kept], self.token_slot[kept]), self.combine_weight[kept], accumulate=True
        )
        return dense.view(tokens, self.num_experts, self.capacity)


@dataclass(frozen=True, kw_only=True)
class ExpertGroup:
    """The process groups of the MoE layers sharing one ``ep_size`` (DeepSpeed's ``ep_size_<n>``).

    Experts are split over the ``expert_parallel`` group (tokens travel by all-to-all); each
    expert is replicated over its ``expert_data_parallel`` group, over which its gradients are
    reduced. A group of one rank is None (there is nothing to communicate).

    Attributes:
        name: ``f"ep_size_{ep_size}"``, the ``group_name`` of the experts' parameters.
        ep_size: ranks in the expert-parallel group.
        rank: this process's global rank.
        expert_parallel_group: process group over ``expert_parallel_ranks``.
        expert_parallel_ranks: global ranks holding the other experts, in expert order.
        expert_data_parallel_group: process group over ``expert_data_parallel_ranks``.
        expert_data_parallel_ranks: global ranks holding replicas of this rank's experts.
    """

    name: str
    ep_size: int
    rank: int
    expert_parallel_group: Any
    expert_parallel_ranks: tuple[int, ...]
    expert_data_parallel_group: Any
    expert_data_parallel_ranks: tuple[int, ...]

    @property
    def expert_parallel_rank(self) -> int:
        """This rank's position in its expert-parallel group (its experts' block index)."""
        return self.expert_parallel_ranks.index(self.rank)

    @property
    def expert_data_parallel_rank(self) -> int:
        """This rank's position in its expert-data-parallel group (0 saves the experts)."""
        return self.expert_data_parallel_ranks.index(self.rank)
