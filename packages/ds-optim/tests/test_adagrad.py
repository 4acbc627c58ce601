"""Adagrad: parity with torch.optim.Adagrad, DeepSpeed's argument and state names,
low-precision params and errors."""

from __future__ import annotations

import pytest
import torch

import ds_optim

PARITY = {"rtol": 1e-6, "atol": 1e-7}


def _params(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(9, 5), (5,), (2, 2, 6)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_torch_adagrad_with_param_groups(weight_decay: float) -> None:
    ours, theirs = _params(0), _params(0)

    def groups(params):
        return [{"params": params[:2]}, {"params": params[2:], "lr": 0.05, "eps": 1e-6}]

    opt = ds_optim.Adagrad(groups(ours), lr=1e-2, weight_decay=weight_decay)
    ref = torch.optim.Adagrad(groups(theirs), lr=1e-2, weight_decay=weight_decay, foreach=False)
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        opt.step()
        ref.step()

    torch.testing.assert_close(ours, theirs, **PARITY)
    for a, b in zip(ours, theirs):
        # DeepSpeed's name for the running sum of squared grads (torch calls it "sum").
        torch.testing.assert_close(opt.state[a]["exp_avg_sq"], ref.state[b]["sum"], **PARITY)
        assert opt.state[a]["step"] == 50


def test_defaults_are_deepspeeds() -> None:
    opt = ds_optim.Adagrad(_params(0))
    assert (opt.defaults["lr"], opt.defaults["eps"], opt.defaults["weight_decay"]) == (
        1e-2,
        1e-10,
        0.0,
    )


def test_fp16_params_keep_an_fp32_sum() -> None:
    params = _params(2, torch.float16)
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt = ds_optim.Adagrad(params, lr=1e-2)
    ref = torch.optim.Adagrad(masters, lr=1e-2, foreach=False)
    gen = torch.Generator().manual_seed(3)
    for _ in range(10):
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.grad = torch.randn(p.shape, generator=gen).to(torch.float16)
                m.copy_(p.float())
                m.grad = p.grad.float()
        opt.step()
        ref.step()
        torch.testing.assert_close(params, [m.detach().half() for m in masters], rtol=0, atol=0)
    assert all(opt.state[p]["exp_avg_sq"].dtype == torch.float32 for p in params)


def test_fp32_optimizer_states_false_keeps_an_fp16_sum() -> None:
    """DeepSpeed's ``fp32_optimizer_states=False``: the sum lives in fp16; each step adds the
    squared gradient in fp32 and rounds the sum back."""
    params = _params(4, torch.float16)
    opt = ds_optim.Adagrad(params, lr=1e-2, fp32_optimizer_states=False)
    sums = [torch.zeros(p.shape, dtype=torch.float16) for p in params]
    gen = torch.Generator().manual_seed(6)
    for _ in range(5):
        expected = []
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=gen).to(torch.float16)
            grad = p.grad.float()
            total = sums[i].float() + grad * grad
            expected.append((p.detach().float() - 1e-2 * grad / (total.sqrt() + 1e-10)).half())
            sums[i] = total.half()
        opt.step()
        torch.testing.assert_close([p.detach() for p in params], expected, rtol=0, atol=0)
        torch.testing.assert_close([opt.state[p]["exp_avg_sq"] for p in params], sums)
    built = ds_optim.build_optimizer(
        {"type": "Adagrad", "params": {"fp32_optimizer_states": False}}, _params(0)
    )
    assert built.fp32_optimizer_states is False


def test_amsgrad_is_rejected() -> None:
    with pytest.raises(ValueError, match="Adagrad: amsgrad=True is not supported"):
        ds_optim.Adagrad(_params(0), amsgrad=True)


def test_negative_lr_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"Adagrad: lr must be a number >= 0, got -0\.1"):
        ds_optim.Adagrad(_params(0), lr=-0.1)
