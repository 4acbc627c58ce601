"""FusedLamb/Lamb: DeepSpeed's per-tensor LAMB against a hand-written reference, the trust ratio
clamp and its zero-norm cases, grad scaling and clipping, low-precision params, errors."""

from __future__ import annotations

import math

import pytest
import torch

import ds_optim

PARITY = {"rtol": 1e-6, "atol": 1e-7}


class _LambByHand:
    """DeepSpeed's fused_lamb_cuda_kernel.cu for one tensor, in float64, written out plainly."""

    def __init__(self, param: torch.Tensor, **hyper: float | bool) -> None:
        self.p = param.detach().double().clone()
        self.m = torch.zeros_like(self.p)
        self.v = torch.zeros_like(self.p)
        self.step = 0
        self.hyper = hyper

    def update(self, grad: torch.Tensor, grad_divisor: float = 1.0) -> float:
        h = self.hyper
        g = grad.double() / grad_divisor
        self.step += 1
        self.m = h["beta1"] * self.m + (1 - h["beta1"]) * g
        self.v = h["beta2"] * self.v + (1 - h["beta2"]) * g * g
        denom = (self.v + h["eps"]).sqrt() if h["eps_inside_sqrt"] else self.v.sqrt() + h["eps"]
        update = self.m / denom + h["weight_decay"] * self.p
        w_norm, u_norm = float(self.p.norm()), float(update.norm())
        coeff = 1.0
        if w_norm != 0 and u_norm != 0:
            coeff = min(max(w_norm / u_norm, h["min_coeff"]), h["max_coeff"])
        step_size = h["lr"]
        if h["bias_correction"]:
            bc1, bc2 = 1 - h["beta1"] ** self.step, 1 - h["beta2"] ** self.step
            step_size = h["lr"] * math.sqrt(bc2) / bc1
        self.p = self.p - step_size * coeff * update
        return coeff


def _params(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(12, 6), (6,), (2, 3, 4)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _hyper(**overrides: float | bool) -> dict[str, float | bool]:
    hyper = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-6, "weight_decay": 0.01}
    hyper.update(eps_inside_sqrt=False, bias_correction=True, max_coeff=10.0, min_coeff=0.01)
    hyper.update(overrides)
    return hyper


def _lamb(params, hyper: dict) -> ds_optim.FusedLamb:
    kwargs = {k: v for k, v in hyper.items() if k not in ("beta1", "beta2")}
    return ds_optim.FusedLamb(params, betas=(hyper["beta1"], hyper["beta2"]), **kwargs)


def _start(
    seed: int, hyper: dict
) -> tuple[list[torch.nn.Parameter], list[_LambByHand], ds_optim.FusedLamb, torch.Generator]:
    """Params, their hand-written references, the optimizer and a grad generator."""
    params = _params(seed)
    refs = [_LambByHand(p, **hyper) for p in params]
    return params, refs, _lamb(params, hyper), torch.Generator().manual_seed(seed + 1)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"weight_decay": 0.0, "bias_correction": False},
        {"eps_inside_sqrt": True, "weight_decay": 0.1},
        {"max_coeff": 0.3, "min_coeff": 0.1},
    ],
    ids=["default", "no-wd-no-bias-correction", "eps-inside-sqrt", "tight-clamp"],
)
def test_matches_hand_written_reference(overrides: dict) -> None:
    params, refs, opt, gen = _start(0, _hyper(**overrides))
    for _ in range(25):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        expected_coeffs = [ref.update(p.grad) for ref, p in zip(refs, params)]
        assert opt.get_lamb_coeffs() == pytest.approx(expected_coeffs, rel=1e-5)

    torch.testing.assert_close([p.detach().double() for p in params], [r.p for r in refs], **PARITY)


def test_trust_ratio_is_clamped_to_max_and_min_coeff() -> None:
    big = torch.nn.Parameter(torch.full((4,), 100.0))  # ||w|| / ||update|| = 100 / 2 = 50
    small = torch.nn.Parameter(torch.full((4,), 1e-4))  # ratio 5e-5
    opt = ds_optim.FusedLamb([big, small], lr=0.1, max_coeff=10.0, min_coeff=0.01)
    big.grad, small.grad = torch.ones(4), torch.ones(4)
    opt.step()
    assert opt.get_lamb_coeffs() == pytest.approx([10.0, 0.01])


def test_trust_ratio_is_one_when_a_norm_is_zero() -> None:
    zero_weight = torch.nn.Parameter(torch.zeros(3))
    zero_update = torch.nn.Parameter(torch.ones(3))  # zero grad, no weight decay: update == 0
    opt = ds_optim.FusedLamb([zero_weight, zero_update], lr=0.1, bias_correction=False)
    zero_weight.grad, zero_update.grad = torch.ones(3), torch.zeros(3)
    opt.step()
    assert opt.get_lamb_coeffs() == [1.0, 1.0]
    # m = 0.1, v = 0.001: the zero weight moves by lr * 1 * m / (sqrt(v) + eps).
    torch.testing.assert_close(
        zero_weight.detach(), torch.full((3,), -0.1 * 0.1 / (0.001**0.5 + 1e-8))
    )
    torch.testing.assert_close(zero_update.detach(), torch.ones(3))


def test_scale_divides_the_grads() -> None:
    hyper = _hyper()
    scaled, plain = _params(2), _params(2)
    opt_scaled, opt_plain = _lamb(scaled, hyper), _lamb(plain, hyper)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        for a, b in zip(scaled, plain):
            b.grad = torch.randn(b.shape, generator=gen)
            a.grad = b.grad * 1024.0
        opt_scaled.step(scale=1024.0)
        opt_plain.step()
    torch.testing.assert_close(scaled, plain, **PARITY)


@pytest.mark.parametrize("pass_norm", [False, True], ids=["computed-norm", "given-norm"])
def test_max_grad_norm_divides_grads_by_the_clip_factor(pass_norm: bool) -> None:
    params, refs, opt, gen = _start(4, _hyper(max_grad_norm=0.5))
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        norm = math.sqrt(sum(float(p.grad.double().norm()) ** 2 for p in params))
        opt.step(grad_norms=[norm] if pass_norm else None)
        clip = (norm + 1e-6) / 0.5
        for ref, p in zip(refs, params):
            ref.update(p.grad, grad_divisor=clip)
    torch.testing.assert_close([p.detach().double() for p in params], [r.p for r in refs], **PARITY)


def test_bf16_params_keep_fp32_state_and_follow_the_reference() -> None:
    hyper = _hyper()
    params = _params(6, torch.bfloat16)
    opt = _lamb(params, hyper)
    gen = torch.Generator().manual_seed(7)
    for _ in range(5):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16)
        # One step from the current (rounded) weights, computed in fp64 then rounded to bf16.
        refs = [_LambByHand(p, **hyper) for p in params]
        for ref, p in zip(refs, params):
            if opt.state[p]:  # carry on from the optimizer's fp32 moments
                ref.m, ref.v = (opt.state[p][k].double() for k in ("exp_avg", "exp_avg_sq"))
                ref.step = opt.state[p]["step"]
        opt.step()
        for ref, p in zip(refs, params):
            ref.update(p.grad)
            torch.testing.assert_close(p.detach(), ref.p.to(torch.bfloat16))
            assert opt.state[p]["exp_avg"].dtype == torch.float32


def test_lamb_is_fused_lamb() -> None:
    assert ds_optim.Lamb is ds_optim.FusedLamb


def test_amsgrad_is_rejected() -> None:
    with pytest.raises(ValueError, match="FusedLamb: amsgrad=True is not supported"):
        ds_optim.FusedLamb(_params(0), amsgrad=True)


def test_min_coeff_above_max_coeff_is_rejected() -> None:
    with pytest.raises(ValueError, match="min_coeff must be <= max_coeff, got min_coeff=2"):
        ds_optim.FusedLamb(_params(0), min_coeff=2.0, max_coeff=1.0)
