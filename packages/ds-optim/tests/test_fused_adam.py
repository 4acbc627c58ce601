"""FusedAdam: parity with torch.optim.Adam/AdamW over 100 steps, low-precision params with fp32
state, per-param step counts, state_dict, argument errors, and the Triton path (interpreter)."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import ds_optim

PARITY = {"rtol": 1e-6, "atol": 1e-7}


def _params(seed: int, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(16, 8), (8,), (3, 5, 7), (1,)]
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def _groups(params: list[torch.nn.Parameter]) -> list[dict]:
    """Three param groups with their own lr and weight decay."""
    return [
        {"params": params[:2]},
        {"params": params[2:3], "lr": 3e-3, "weight_decay": 0.0},
        {"params": params[3:], "lr": 2e-2, "weight_decay": 0.3},
    ]


def _set_grads(params: list[torch.Tensor], gen: torch.Generator, dtype: torch.dtype) -> None:
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(dtype)


def _copy(params: list[torch.nn.Parameter], dtype: torch.dtype) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().to(dtype).clone()) for p in params]


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam-l2"])
def test_matches_torch_over_100_steps_with_param_groups(adam_w_mode: bool) -> None:
    ours, theirs = _params(0), _params(0)
    hyper = {"lr": 1e-2, "betas": (0.8, 0.99), "eps": 1e-7, "weight_decay": 0.05}
    opt = ds_optim.FusedAdam(_groups(ours), adam_w_mode=adam_w_mode, **hyper)
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref = torch_cls(_groups(theirs), foreach=False, **hyper)
    gen = torch.Generator().manual_seed(1)

    for _ in range(100):
        _set_grads(ours, gen, torch.float32)
        for a, b in zip(theirs, ours):
            a.grad = b.grad.clone()
        opt.step()
        ref.step()

    torch.testing.assert_close(ours, theirs, **PARITY)
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(opt.state[b]["exp_avg_sq"], ref.state[a]["exp_avg_sq"], **PARITY)


def _adam_by_hand(p, g, m, v, *, lr, beta1, beta2, eps, weight_decay, adam_w_mode) -> None:
    """Adam without bias correction, element by element in float64 (a formula, not a kernel)."""
    for i in range(p.numel()):
        grad = float(g.view(-1)[i])
        param = float(p.view(-1)[i])
        if adam_w_mode:
            param *= 1 - lr * weight_decay
        else:
            grad += weight_decay * param
        m.view(-1)[i] = beta1 * float(m.view(-1)[i]) + (1 - beta1) * grad
        v.view(-1)[i] = beta2 * float(v.view(-1)[i]) + (1 - beta2) * grad * grad
        p.view(-1)[i] = param - lr * float(m.view(-1)[i]) / (math.sqrt(v.view(-1)[i]) + eps)


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam-l2"])
def test_without_bias_correction_matches_the_formula(adam_w_mode: bool) -> None:
    ours = _params(2)[:2]
    expected = [p.detach().double().clone() for p in ours]
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in expected]
    hyper = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1}
    opt = ds_optim.FusedAdam(
        ours,
        lr=hyper["lr"],
        betas=(hyper["beta1"], hyper["beta2"]),
        eps=hyper["eps"],
        weight_decay=hyper["weight_decay"],
        adam_w_mode=adam_w_mode,
        bias_correction=False,
    )
    gen = torch.Generator().manual_seed(3)
    for _ in range(10):
        _set_grads(ours, gen, torch.float32)
        opt.step()
        for p, g, (m, v) in zip(expected, ours, moments):
            _adam_by_hand(p, g.grad.double(), m, v, adam_w_mode=adam_w_mode, **hyper)

    torch.testing.assert_close([p.detach().double() for p in ours], expected, **PARITY)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_params_keep_fp32_state_and_round_once_per_step(dtype: torch.dtype) -> None:
    ours = _params(4, dtype)
    # Reference: torch AdamW on fp32 copies with fp32 state, re-seeded from the rounded params
    # before every step and rounded after it, which is what fp32 state with fp16/bf16 params is.
    masters = _copy(ours, torch.float32)
    opt = ds_optim.FusedAdam(ours, lr=1e-2, weight_decay=0.01)
    ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.01, foreach=False)
    gen = torch.Generator().manual_seed(5)

    for _ in range(20):
        _set_grads(ours, gen, dtype)
        with torch.no_grad():
            for master, p in zip(masters, ours):
                master.copy_(p.float())
                master.grad = p.grad.float()
        opt.step()
        ref.step()
        torch.testing.assert_close(ours, [m.detach().to(dtype) for m in masters], rtol=0, atol=0)

    for p in ours:
        assert opt.state[p]["exp_avg"].dtype == torch.float32
        assert opt.state[p]["exp_avg_sq"].dtype == torch.float32


def test_params_without_grad_do_not_advance_their_step() -> None:
    ours, theirs = _params(6), _params(6)
    opt = ds_optim.FusedAdam(ours, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, foreach=False)
    gen = torch.Generator().manual_seed(7)
    for step in range(12):
        _set_grads(ours, gen, torch.float32)
        if step % 3:
            ours[1].grad = None  # skipped: its bias correction must lag behind the others'
        for a, b in zip(theirs, ours):
            a.grad = None if b.grad is None else b.grad.clone()
        opt.step()
        ref.step()

    assert opt.state[ours[1]]["step"] == 4
    assert opt.state[ours[0]]["step"] == 12
    torch.testing.assert_close(ours, theirs, **PARITY)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_state_dict_round_trip_resumes_exactly(dtype: torch.dtype) -> None:
    straight, resumed = _params(8, dtype), _params(8, dtype)
    opt = ds_optim.FusedAdam(straight, lr=1e-2)
    first = ds_optim.FusedAdam(resumed, lr=1e-2)
    gen_a, gen_b = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    for _ in range(5):
        _set_grads(straight, gen_a, dtype)
        _set_grads(resumed, gen_b, dtype)
        opt.step()
        first.step()

    second = ds_optim.FusedAdam(resumed, lr=1e-2)
    second.load_state_dict(first.state_dict())
    assert second.state[resumed[0]]["exp_avg"].dtype == torch.float32
    for _ in range(5):
        _set_grads(straight, gen_a, dtype)
        _set_grads(resumed, gen_b, dtype)
        opt.step()
        second.step()
    torch.testing.assert_close(straight, resumed, rtol=0, atol=0)


def test_closure_is_evaluated_with_grad_enabled() -> None:
    (p,) = _params(10)[:1]
    opt = ds_optim.FusedAdam([p], lr=0.1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss.requires_grad and p.grad is not None


@pytest.mark.parametrize("set_grad_none", [True, False])
def test_zero_grad_follows_set_grad_none(set_grad_none: bool) -> None:
    params = _params(11)
    opt = ds_optim.FusedAdam(params, set_grad_none=set_grad_none)
    _set_grads(params, torch.Generator().manual_seed(0), torch.float32)
    opt.zero_grad()
    if set_grad_none:
        assert all(p.grad is None for p in params)
    else:
        assert all(torch.count_nonzero(p.grad) == 0 for p in params)


def test_amsgrad_is_rejected_with_the_alternative() -> None:
    with pytest.raises(ValueError, match=r"amsgrad=True is not supported.*torch.optim.Adam"):
        ds_optim.FusedAdam(_params(0), amsgrad=True)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": -1.0}, "lr must be a number >= 0, got -1.0"),
        ({"eps": float("nan")}, "eps must be a number >= 0"),
        ({"betas": (0.9, 1.0)}, r"betas must both be in \[0, 1\)"),
        ({"betas": 0.9}, "betas must be two numbers"),
        ({"weight_decay": float("inf")}, "weight_decay must be finite"),
    ],
)
def test_bad_hyperparameters(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ds_optim.FusedAdam(_params(0), **kwargs)


def test_sparse_grads_are_rejected() -> None:
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4).to_sparse()
    with pytest.raises(RuntimeError, match="FusedAdam does not support sparse gradients"):
        ds_optim.FusedAdam([p]).step()


_TRITON_SCRIPT = textwrap.dedent(
    """
    import torch, ds_optim

    def run(backend):
        gen = torch.Generator().manual_seed(0)
        params = [
            torch.nn.Parameter(torch.randn(s, generator=gen).to(dt))
            for s, dt in [((33, 40), torch.float32), ((7,), torch.float32), ((5, 3), torch.float16)]
        ]
        groups = [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}]
        opt = ds_optim.FusedAdam(groups, lr=1e-2, weight_decay=0.1, backend=backend)
        for _ in range(4):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
            opt.step()
        return params

    triton, reference = run("triton"), run("torch")
    for a, b in zip(triton, reference):
        tol = {} if a.dtype == torch.float16 else {"rtol": 1e-6, "atol": 1e-7}
        torch.testing.assert_close(a, b, **tol)
    print("ok")
    """
)


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("numpy") is None,
    reason="needs triton and numpy (the Triton interpreter)",
)
@pytest.mark.slow  # a fresh interpreter process; ds-kernels tests the Triton Adam kernel itself by default
def test_triton_path_matches_torch_path_under_the_interpreter(tmp_path) -> None:
    # TRITON_INTERPRET must be set before ds_kernels is first imported: use a fresh process.
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-c", _TRITON_SCRIPT],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
