"""Lion: the paper's update against a hand-written per-tensor reference, weight decay, sign of
zero, param groups, low-precision params and set_grad_none."""

from __future__ import annotations

import pytest
import torch

import ds_optim

PARITY = {"rtol": 1e-6, "atol": 1e-7}


def _lion_by_hand(p, g, m, *, lr: float, beta1: float, beta2: float, weight_decay: float):
    """Algorithm 2 of Chen et al. (2023), one tensor; returns the new (p, m)."""
    direction = torch.sign(beta1 * m + (1 - beta1) * g)
    p = p * (1 - lr * weight_decay) - lr * direction
    return p, beta2 * m + (1 - beta2) * g


def _params(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(10, 4), (4,), (3, 3, 3)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def test_matches_the_paper_update_with_param_groups() -> None:
    params = _params(0)
    settings = [
        {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.0},
        {"lr": 3e-3, "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.5},
    ]
    groups = [
        {"params": params[:2]},
        {"params": params[2:], "lr": 3e-3, "weight_decay": 0.5, "betas": (0.9, 0.99)},
    ]
    opt = ds_optim.Lion(groups, lr=1e-3)
    expected = [
        (p.detach().double().clone(), torch.zeros_like(p, dtype=torch.float64)) for p in params
    ]
    hyper_of = [settings[0], settings[0], settings[1]]
    gen = torch.Generator().manual_seed(1)

    for _ in range(30):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        expected = [
            _lion_by_hand(ep, p.grad.double(), em, **hyper)
            for (ep, em), p, hyper in zip(expected, params, hyper_of)
        ]

    torch.testing.assert_close(
        [p.detach().double() for p in params], [e[0] for e in expected], **PARITY
    )
    for p, (_, em) in zip(params, expected):
        torch.testing.assert_close(opt.state[p]["exp_avg"].double(), em, **PARITY)


def test_every_coordinate_moves_by_lr() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0, 1.0, 1.0]))
    opt = ds_optim.Lion([p], lr=0.25)
    p.grad = torch.tensor([1e-6, -3.0, 0.0])  # sign(0) = 0: a zero gradient leaves it alone
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([0.75, 1.25, 1.0]))


def test_bf16_params_keep_fp32_momentum() -> None:
    params = _params(2, torch.bfloat16)
    opt = ds_optim.Lion(params, lr=1e-2, weight_decay=0.1)
    masters = [p.detach().double() for p in params]
    moments = [torch.zeros_like(m) for m in masters]
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
        opt.step()
        for i, p in enumerate(params):
            masters[i], moments[i] = _lion_by_hand(
                masters[i],
                p.grad.double(),
                moments[i],
                lr=1e-2,
                beta1=0.9,
                beta2=0.999,
                weight_decay=0.1,
            )
            torch.testing.assert_close(p.detach(), masters[i].to(torch.bfloat16))
            masters[i] = p.detach().double()  # the param is rounded to bf16 every step
    assert all(opt.state[p]["exp_avg"].dtype == torch.float32 for p in params)


def test_betas_default_to_deepspeeds() -> None:
    assert ds_optim.Lion(_params(0)).defaults["betas"] == (0.9, 0.999)  # DeepSpeed's FusedLion


@pytest.mark.parametrize("set_grad_none", [True, False])
def test_zero_grad_follows_set_grad_none(set_grad_none: bool) -> None:
    params = _params(4)
    opt = ds_optim.Lion(params, set_grad_none=set_grad_none)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.zero_grad()
    assert all((p.grad is None) == set_grad_none for p in params)


def test_bad_betas_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"Lion: betas must both be in \[0, 1\)"):
        ds_optim.Lion(_params(0), betas=(1.2, 0.99))


def test_fp32_optimizer_states_false_keeps_bf16_momentum() -> None:
    """DeepSpeed's ``fp32_optimizer_states=False``: the momentum lives in the param's dtype
    and is the fp32 update's momentum rounded to it, step by step."""
    params = _params(4, torch.bfloat16)
    opt = ds_optim.Lion(params, lr=1e-2, weight_decay=0.1, fp32_optimizer_states=False)
    masters = [p.detach().double() for p in params]
    moments = [torch.zeros_like(m) for m in masters]
    gen = torch.Generator().manual_seed(5)
    for _ in range(5):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
        opt.step()
        for i, p in enumerate(params):
            masters[i], moments[i] = _lion_by_hand(
                masters[i],
                p.grad.double(),
                moments[i],
                lr=1e-2,
                beta1=0.9,
                beta2=0.999,
                weight_decay=0.1,
            )
            moments[i] = moments[i].to(torch.bfloat16).double()  # stored in bf16
            torch.testing.assert_close(p.detach(), masters[i].to(torch.bfloat16))
            torch.testing.assert_close(opt.state[p]["exp_avg"], moments[i].to(torch.bfloat16))
            masters[i] = p.detach().double()
    assert opt.fp32_optimizer_states is False
    with pytest.raises(ValueError, match="fp32_optimizer_states"):
        ds_optim.Lion(params, fp32_optimizer_states="no")
