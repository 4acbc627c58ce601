"""The MoE layer (DeepSpeed's ``MoE``, ``MOELayer`` and ``Experts``), with expert parallelism.

[Note: expert-parallel forward]
With ``E`` experts over an expert-parallel group of ``ep_size`` ranks, rank ``r`` holds global
experts ``r * nl ... (r + 1) * nl - 1`` (``nl = E / ep_size``). Each rank routes its own tokens
over all ``E`` experts into a ``[E * C, hidden]`` buffer, which is laid out
``[ep_size, nl, C, hidden]`` by destination rank, so one equal-split all-to-all delivers to every
rank the slots of its experts from every rank: ``[ep_size (source), nl, C, hidden]``. Local
expert ``i`` runs once on its ``ep_size * C`` rows; the outputs go back by the same all-to-all and
are combined on the token's own rank. Every rank of the group must therefore route the same
number of tokens per step (so that ``C`` agrees), as in DeepSpeed; without ``drop_tokens`` the
gate agrees on ``C`` itself with a MAX all-reduce.

State-dict keys keep DeepSpeed's names (``deepspeed_moe.gate.wg.weight``,
``deepspeed_moe.experts.deepspeed_experts.<local id>.*``, ``mlp.*``, ``coefficient.*``), so
checkpoints map one to one.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from ds_comm import ConfigError
from ds_moe._gating import TopKGate
from ds_moe._routing import all_to_all, combine, dispatch
from ds_moe.api import ExpertGroup

__all__ = ["MOELayer", "Experts", "MoE"]


class Experts(nn.Module):
    """``num_local_experts`` deep copies of ``expert``, tagged as expert parameters.

    Every parameter gets ``allreduce = False`` and ``group_name = expert_group_name`` (DeepSpeed's
    tags, read by :func:`~ds_moe.is_moe_param` and the optimizer/ZeRO param-group split).

    Args:
        expert: module mapping ``[tokens, hidden]`` to ``[tokens, hidden]`` (or a tuple whose
            first element is that, as Megatron's MLPs return).
        num_local_experts: copies held by this rank.
        expert_group_name: ``ep_size_<n>``.
    """

    def __init__(
        self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None
    ) -> None:
        super().__init__()
        self.num_local_experts = num_local_experts
        self.deepspeed_experts = nn.ModuleList(
            [copy.deepcopy(expert) for _ in range(num_local_experts)]
        )
        for local in self.deepspeed_experts:
            for param in local.parameters():
                param.allreduce = False  # type: ignore[attr-defined]
                param.group_name = expert_group_name  # type: ignore[attr-defined]

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Runs local expert ``i`` on ``inputs[:, i]``: ``[ep_size, nl, C, hidden]`` in and out."""
        ep_size, _, cap, hidden = inputs.shape
        outputs = []
        for i, expert in enumerate(self.deepspeed_experts):
            out = expert(inputs[:, i].reshape(ep_size * cap, hidden))
            if isinstance(out, tuple):
                out = out[0]  # Megatron MLPs return (output, bias)
            outputs.append(out.reshape(ep_size, cap, -1))
        return torch.stack(outputs, dim=1)


class MOELayer(nn.Module):
    """Gate, dispatch, all-to-all, experts, all-to-all, combine (DeepSpeed's ``MOELayer``).

    See [Note: expert-parallel forward]. After each forward, ``l_aux`` and ``exp_counts`` hold
    the gate's load-balancing loss and per-expert token counts.
    """

    def __init__(
        self,
        gate: TopKGate,
        experts: Experts,
        ep_group_name: str,
        ep_size: int,
        num_local_experts: int,
    ) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group_name = ep_group_name
        self.ep_size = ep_size
        self.num_local_experts = num_local_experts
        self.ep_group: object | None = None
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None

    def _set_ep_group(self, ep_group: object) -> None:
        self.ep_group = ep_group
        self.gate.ep_group = ep_group

    def forward(
        self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Routes ``[..., hidden]`` tokens through the experts; returns the same shape."""
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(
                f"MoE layer with ep_size={self.ep_size} has no expert-parallel process group: "
                "call ds_moe.configure_expert_parallelism(model) on every rank before the "
                "first forward"
            )
        hidden = hidden_states.shape[-1]
        tokens = hidden_states.reshape(-1, hidden)
        used = None if used_token is None else used_token.reshape(-1)
        routing = self.gate(tokens, used)
        self.l_aux, self.exp_counts = routing.l_aux, routing.exp_counts

        slots = dispatch(tokens, routing)
        if self.ep_size > 1:
            slots = all_to_all(slots, self.ep_group)
        shape = (self.ep_size, self.num_local_experts, routing.capacity, hidden)
        expert_out = self.experts(slots.view(shape)).reshape(-1, hidden)
        if self.ep_size > 1:
            expert_out = all_to_all(expert_out, self.ep_group)
        return combine(expert_out.to(tokens.dtype), routing).view(hidden_states.shape)


class MoE(nn.Module):
    """A mixture-of-experts layer (DeepSpeed's ``deepspeed.moe.layer.MoE``, same arguments).

    Args:
        hidden_size: the model's hidden size (input and output size of the layer).
        expert: the expert module (e.g. an MLP); copied ``num_experts / ep_size`` times.
        num_experts: experts in the layer, over all expert-parallel ranks.
        ep_size: ranks the experts are split over; ``num_experts % ep_size == 0``.
        k: experts per token, 1 or 2.
        capacity_factor, eval_capacity_factor, min_capacity, noisy_gate_policy, drop_tokens,
            use_rts, top2_2nd_expert_sampling: gating policy; see :class:`~ds_moe.GateConfig`.
        use_residual: PR-MoE's residual MoE: ``expert`` itself also runs as a dense MLP on every
            token, mixed with the MoE output by a learned per-token softmax coefficient.
        enable_expert_tensor_parallelism: accepted for DeepSpeed compatibility; it only matters
            with tensor parallelism, which ds does not provide (see docs/moe.md).

    ``forward(hidden_states, used_token=None)`` returns ``(output, l_aux, exp_counts)``. With
    ``ep_size > 1`` call :func:`~ds_moe.configure_expert_parallelism` first.

    Example:
        >>> expert = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
        >>> moe = MoE(16, expert, num_experts=4, k=2)
        >>> out, l_aux, exp_counts = moe(torch.randn(2, 8, 16))
        >>> out.shape, exp_counts.sum().item()
        (torch.Size([2, 8, 16]), 32)
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        top2_2nd_expert_sampling: bool = True,
        enable_expert_tensor_parallelism: bool = False,
    ) -> None:
        super().__init__()
        _check_layout(hidden_size, num_experts, ep_size)
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            None,
            top2_2nd_expert_sampling,
        )
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(
            gate, experts, self.expert_group_name, ep_size, self.num_local_experts
        )
        self.expert_group: ExpertGroup | None = None
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_expert_group(self, group: ExpertGroup) -> None:
        """Use ``group``'s expert-parallel process group (from ``ExpertParallelGroups``)."""
        if group.ep_size != self.ep_size:
            raise ValueError(
                f"expert group {group.name!r} has ep_size={group.ep_size} but this layer was "
                f"built with ep_size={self.ep_size}"
            )
        self.expert_group = group
        self.deepspeed_moe._set_ep_group(group.expert_parallel_group)

    def forward(
        self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns ``(output, l_aux, exp_counts)``; ``output`` has the shape of the input.

        ``exp_counts`` (int64, on the input's device) counts each expert's tokens before drops;
        ``used_token`` (one entry per token, 0 = padding) keeps tokens out of routing.
        """
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        moe = self.deepspeed_moe
        assert moe.l_aux is not None and moe.exp_counts is not None
        return output, moe.l_aux, moe.exp_counts


def _check_layout(hidden_size: int, num_experts: int, ep_size: int) -> None:
    for name, value in (("hidden_size", hidden_size), ("num_experts", num_experts)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"MoE {name} = {value!r}: expected an int >= 1")
    if not isinstance(ep_size, int) or isinstance(ep_size, bool) or ep_size < 1:
        raise ConfigError(f"MoE ep_size = {ep_size!r}: expected an int >= 1")
    if num_experts % ep_size:
        raise ConfigError(
            f"MoE num_experts = {num_experts} is not divisible by ep_size = {ep_size}: every "
            f"expert-parallel rank holds num_experts / ep_size experts; choose num_experts as a "
            f"multiple of {ep_size} or an ep_size dividing {num_experts}"
        )
