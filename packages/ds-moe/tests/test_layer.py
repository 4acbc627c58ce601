"""The MoE layer in one process: the fused dispatch/combine path against DeepSpeed's einsum
formulation (outputs and every gradient), PR-MoE's residual mix, parameter tags, dtypes, errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ds_moe
from ds_comm import ConfigError

HIDDEN = 8


def _moe(num_experts: int = 4, seed: int = 0, **kwargs: object) -> ds_moe.MoE:
    torch.manual_seed(seed)
    expert = nn.Sequential(nn.Linear(HIDDEN, 16), nn.GELU(), nn.Linear(16, HIDDEN))
    moe = ds_moe.MoE(HIDDEN, expert, num_experts=num_experts, **kwargs)
    with torch.no_grad():
        for p in moe.parameters():  # the deep copies start equal: make the experts differ
            p.add_(torch.randn_like(p) * 0.3)
    return moe


def _einsum_forward(moe: ds_moe.MoE, x: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's MOELayer: dense one-hot dispatch and combine by einsum."""
    layer = moe.deepspeed_moe
    tokens = x.reshape(-1, HIDDEN)
    combine = layer.gate(tokens).dense_combine_weights()
    dispatched = torch.einsum("sec,sm->ecm", (combine > 0).to(tokens.dtype), tokens)
    outputs = torch.stack(
        [expert(dispatched[e]) for e, expert in enumerate(layer.experts.deepspeed_experts)]
    )
    return torch.einsum("sec,ecm->sm", combine, outputs).view(x.shape)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("drop_tokens", [True, False])
def test_fused_routing_matches_einsum_formulation(k: int, drop_tokens: bool) -> None:
    moe = _moe(k=k, drop_tokens=drop_tokens, capacity_factor=0.75, min_capacity=0, use_rts=False)
    moe.eval()  # no sampling: both runs route identically
    x = torch.randn(3, 10, HIDDEN, generator=torch.Generator().manual_seed(1))
    target = torch.randn_like(x)

    def grads(forward) -> tuple[torch.Tensor, list[torch.Tensor]]:
        moe.zero_grad()
        xs = x.clone().requires_grad_()
        out = forward(xs)
        (out * target).sum().backward()
        return out.detach(), [xs.grad, *(p.grad for p in moe.parameters())]

    out, got = grads(lambda xs: moe(xs)[0])
    ref_out, expected = grads(lambda xs: _einsum_forward(moe, xs))

    torch.testing.assert_close(out, ref_out)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    assert moe.deepspeed_moe.gate.wg.weight.grad.abs().sum() > 0  # gate learns via weights


def test_dropped_tokens_output_zero() -> None:
    moe = _moe(num_experts=2, capacity_factor=0.25, min_capacity=0, use_rts=False)
    x = torch.randn(16, HIDDEN)
    out, _, counts = moe(x)
    routing = moe.deepspeed_moe.gate(x)
    dropped = routing.token_slot[:, 0] < 0
    assert int(dropped.sum()) == int((counts - routing.capacity).clamp(min=0).sum()) > 0
    assert torch.all(out[dropped] == 0) and torch.all(out[~dropped].abs().sum(1) > 0)


def test_residual_mixes_moe_and_dense_mlp_by_learned_coefficient() -> None:
    moe = _moe(use_residual=True).eval()  # eval: routing is deterministic across the two calls
    x = torch.randn(2, 6, HIDDEN)
    out, _, _ = moe(x)
    coef = torch.softmax(moe.coefficient(x), dim=-1)
    expected = moe.deepspeed_moe(x) * coef[..., :1] + moe.mlp(x) * coef[..., 1:]
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert moe.coefficient.weight.grad is not None and moe.mlp[0].weight.grad is not None


def test_expert_params_are_tagged_and_dense_ones_are_not() -> None:
    moe = _moe(use_residual=True)
    expert_names = {n for n, p in moe.named_parameters() if ds_moe.is_moe_param(p)}
    assert expert_names == {
        n for n, _ in moe.named_parameters() if n.startswith("deepspeed_moe.experts.")
    }
    assert {p.group_name for p in moe.parameters() if ds_moe.is_moe_param(p)} == {"ep_size_1"}
    assert len(moe.deepspeed_moe.experts.deepspeed_experts) == 4


def test_state_dict_keys_are_deepspeeds() -> None:
    keys = set(_moe(num_experts=2, use_residual=True).state_dict())
    assert "deepspeed_moe.gate.wg.weight" in keys
    assert "deepspeed_moe.experts.deepspeed_experts.1.2.bias" in keys
    assert {"mlp.0.weight", "coefficient.weight", "coefficient.bias"} <= keys


def test_returns_l_aux_and_exp_counts_per_call() -> None:
    moe = _moe(k=2)
    x = torch.randn(5, 4, HIDDEN)
    _, l_aux, counts = moe(x)
    assert l_aux.dim() == 0 and l_aux.requires_grad
    assert counts.dtype == torch.int64 and counts.shape == (4,) and int(counts.sum()) == 2 * 20
    _, _, used_counts = moe(x, used_token=torch.ones(5, 4).index_fill_(1, torch.tensor([0]), 0))
    assert int(used_counts.sum()) == 2 * 15


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_runs_with_float32_gate(dtype: torch.dtype) -> None:
    moe = _moe(k=2).to(dtype).eval()
    reference = copy.deepcopy(moe).float()  # the same (rounded) weights: the same routing
    x = torch.randn(4, 6, HIDDEN, dtype=dtype, requires_grad=True)
    out, l_aux, _ = moe(x)
    assert out.dtype == dtype and l_aux.dtype == torch.float32
    reference, _, _ = reference(x.detach().float())
    torch.testing.assert_close(out.float(), reference, atol=0.1, rtol=0.05)
    out.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == dtype


def test_num_experts_must_divide_by_ep_size() -> None:
    with pytest.raises(ConfigError, match="num_experts = 6 is not divisible by ep_size = 4"):
        _moe(num_experts=6, ep_size=4)


def test_bad_k_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"moe\.k = 4"):
        _moe(k=4)


def test_has_moe_layers() -> None:
    assert ds_moe.has_moe_layers(nn.Sequential(nn.Linear(2, 2), _moe(num_experts=2))) == (True, 2)
    assert ds_moe.has_moe_layers(nn.Linear(2, 2)) == (False, 0)


@pytest.mark.gpu(1)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [1, 2])
def test_cuda_triton_routing_matches_cpu(k: int) -> None:
    moe = _moe(k=k, capacity_factor=0.75, min_capacity=0, use_rts=False).eval()
    x = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(2))
    out, _, _ = moe(x.requires_grad_())
    out.square().sum().backward()
    cpu_grads = [p.grad.clone() for p in moe.parameters()]
    moe.zero_grad()
    cuda = moe.cuda()
    x_cuda = x.detach().cuda().requires_grad_()
    out_cuda, _, _ = cuda(x_cuda)
    out_cuda.square().sum().backward()
    torch.testing.assert_close(out_cuda.cpu(), out.detach(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(x_cuda.grad.cpu(), x.grad, atol=1e-4, rtol=1e-4)
    for p, g in zip(cuda.parameters(), cpu_grads):
        torch.testing.assert_close(p.grad.cpu(), g, atol=1e-4, rtol=1e-4)
