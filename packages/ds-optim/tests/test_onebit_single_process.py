"""One process (no process group, and a group of one rank): nothing is compressed, so every step
must equal a per-tensor reference written from the papers and DeepSpeed's code, with ds-optim's
bias correction; the warmup of 1-bit Adam is torch's Adam/AdamW."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from ds_testing import run_on_ranks

_SHAPES = [(7, 5), (5,), (33,), (1,)]
_STEPS = 40


def _params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(shape, generator=g) for shape in _SHAPES]


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    """A noisy pull towards 1: gradients that shrink as training goes, like real ones."""
    g = torch.Generator().manual_seed(100 + step)
    return [(p - 1.0) + 0.3 * torch.randn(p.shape, generator=g) for p in params]


def _run_ours(name: str, hyper: dict[str, Any], groups: list[dict[str, Any]]) -> list[torch.Tensor]:
    import ds_optim

    params = [torch.nn.Parameter(p.clone()) for p in _params()]
    split = [{"params": params[:2], **groups[0]}, {"params": params[2:], **groups[1]}]
    optimizer = getattr(ds_optim, name)(split, **hyper)
    for step in range(1, _STEPS + 1):
        for p, grad in zip(params, _grads([p.detach() for p in params], step)):
            p.grad = grad
        optimizer.step()
    return [p.detach() for p in params]


def _run_reference(
    update: Callable[..., None], hyper: dict[str, Any], groups: list[dict[str, Any]]
) -> list[torch.Tensor]:
    params = _params()
    per_param = [groups[0]] * 2 + [groups[1]] * 2
    states: list[dict[str, Any]] = [{} for _ in params]
    for step in range(1, _STEPS + 1):
        grads = _grads(params, step)
        for members, group in (((0, 1), groups[0]), ((2, 3), groups[1])):
            max_norm = {**hyper, **group}.get("max_grad_norm", 0.0)
            norm = math.sqrt(sum(grads[i].square().sum().item() for i in members))
            for i in members:
                grads[i] *= min(1.0, max_norm / (norm + 1e-6)) if max_norm else 1.0
        for p, grad, state, group in zip(params, grads, states, per_param):
            update(p, grad, state, step, {**hyper, **group})
    return params


def _corrections(h: dict[str, Any], step: int, variance_steps: int) -> tuple[float, float]:
    if not h.get("bias_correction", True):
        return 1.0, 1.0
    beta1, beta2 = h.get("betas", (0.9, 0.999))
    return 1 - beta1**step, 1 - beta2**variance_steps


def _denominator(v: torch.Tensor, correction2: float, h: dict[str, Any]) -> torch.Tensor:
    eps = h.get("eps", 1e-8)
    if h.get("eps_inside_sqrt", False):
        return (v / correction2 + eps).sqrt()
    return (v / correction2).sqrt() + eps


# --- references: one tensor at a time ------------------------------------------------------------


def _onebit_adam(
    p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], step: int, h: dict[str, Any]
) -> None:
    beta1, beta2 = h.get("betas", (0.9, 0.999))
    m = state.setdefault("m", torch.zeros_like(p))
    v = state.setdefault("v", torch.zeros_like(p))
    m.mul_(beta1).add_(grad, alpha=1 - beta1)
    if step <= h["freeze_step"]:
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    c1, c2 = _corrections(h, step, min(step, h["freeze_step"]))
    update = (m / c1) / _denominator(v, c2, h) + h.get("weight_decay", 0.0) * p
    p.sub_(h["lr"] * update)


def _zero_one_adam(
    p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], step: int, h: dict[str, Any]
) -> None:
    """DeepSpeed's formulation: local updates accumulate in a buffer that is undone at a sync."""
    beta1, beta2 = h.get("betas", (0.9, 0.999))
    m = state.setdefault("m", torch.zeros_like(p))
    v = state.setdefault("v", torch.zeros_like(p))
    s = state.setdefault("s", {"var_interval": 1, "var_counter": 0, "var_updates": 0})
    s.setdefault("local_interval", 1)
    s.setdefault("local_counter", 0)
    s.setdefault("lrs", 0.0)
    accumulated = state.setdefault("accumulated", torch.zeros_like(p))
    m.mul_(beta1).add_(grad, alpha=1 - beta1)
    if step <= h["var_freeze_step"] and step % s["var_interval"] == 0:
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        s["var_updates"] += 1
        s["var_counter"] += 1
        if s["var_counter"] == h["var_update_scaler"]:
            s["var_counter"], s["var_interval"] = 0, s["var_interval"] * 2
    c1, c2 = _corrections(h, step, s["var_updates"])
    denom = _denominator(v, c2, h)
    update = (m / c1) / denom + h.get("weight_decay", 0.0) * p
    p.sub_(h["lr"] * update)
    if step > h["var_freeze_step"]:
        accumulated.sub_(h["lr"] * update)
        s["lrs"] += h["lr"] / c1
        if step % s["local_interval"] == 0:
            p.sub_(accumulated)
            accumulated.mul_(denom)  # one rank: the "average" is the buffer itself
            m.copy_(-accumulated / s["lrs"])
            p.add_(accumulated / denom)
            accumulated.zero_()
            s["lrs"] = 0.0
        s["local_counter"] += 1
        if s["local_counter"] == h["local_step_scaler"]:
            s["local_counter"] = 0
            s["local_interval"] = min(h["local_step_clipper"], s["local_interval"] * 2)


def _onebit_lamb(
    p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], step: int, h: dict[str, Any]
) -> None:
    beta1, beta2 = h.get("betas", (0.9, 0.999))
    wd, eps = h.get("weight_decay", 0.0), h.get("eps", 1e-8)
    m = state.setdefault("m", torch.zeros_like(p))
    v = state.setdefault("v", torch.zeros_like(p))
    state.setdefault("coeff_freeze", 0.0)
    state.setdefault("last_factor", 1.0)
    previous = m.clone()
    m.mul_(beta1).add_(grad, alpha=1 - beta1)
    c1, c2 = _corrections(h, step, step)
    step_size = h["lr"] * math.sqrt(c2) / c1  # FusedLamb's bias correction
    if step <= h["freeze_step"]:
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        if step == h["freeze_step"]:
            state["fresh"] = v.clone()
        update = m / (v.sqrt() + eps) + wd * p
        w_norm, u_norm = p.norm().item(), update.norm().item()
        coeff = (
            min(max(w_norm / u_norm, h["min_coeff"]), h["max_coeff"]) if w_norm and u_norm else 1
        )
        if coeff != 1.0:
            beta = h.get("coeff_beta", 0.9)
            state["coeff_freeze"] = beta * state["coeff_freeze"] + (1 - beta) * coeff
    else:
        rebuilt = (m - beta1 * previous) / (1 - beta1)
        fresh = state["fresh"].mul_(beta2).addcmul_(rebuilt, rebuilt, value=1 - beta2)
        denom = v.sqrt() + eps
        plain = m / denom
        update = plain + wd * p
        factor = (denom / (fresh.sqrt() + eps)).max().item()
        if wd > 0:
            ratio = min(1.0, (plain.norm() / update.norm()).item())
            factor = factor * ratio + (1.0 - ratio)
        factor = min(max(factor, h.get("factor_min", 0.5)), h.get("factor_max", 4.0))
        last, threshold = state["last_factor"], h.get("factor_threshold", 0.1)
        factor = max(min(factor, last * (1 + threshold)), last * (1 - threshold))
        state["last_factor"] = factor
        coeff = state["coeff_freeze"] * factor
    p.sub_(step_size * coeff * update)


_REFERENCES = {
    "OneBitAdam": _onebit_adam,
    "ZeroOneAdam": _zero_one_adam,
    "OneBitLamb": _onebit_lamb,
}

_CASES: list[tuple[str, dict[str, Any], list[dict[str, Any]]]] = [
    ("OneBitAdam", {"freeze_step": 10}, [{"lr": 0.05}, {"lr": 0.02}]),
    ("OneBitAdam", {"freeze_step": 10, "max_grad_norm": 1.0}, [{"lr": 0.05}, {"lr": 0.02}]),
    (
        "OneBitAdam",
        {"freeze_step": 13, "bias_correction": False, "eps_inside_sqrt": True, "eps": 1e-6},
        [{"lr": 0.03, "weight_decay": 0.1}, {"lr": 0.01}],
    ),
    (
        "ZeroOneAdam",
        {"var_freeze_step": 15, "var_update_scaler": 3, "local_step_scaler": 5},
        [{"lr": 0.05}, {"lr": 0.02, "weight_decay": 0.05}],
    ),
    (
        "ZeroOneAdam",
        {
            "var_freeze_step": 9,
            "var_update_scaler": 2,
            "local_step_scaler": 3,
            "bias_correction": False,
        },
        [{"lr": 0.02}, {"lr": 0.02, "betas": (0.8, 0.99)}],
    ),
    (
        "OneBitLamb",
        {"freeze_step": 12, "min_coeff": 0.01, "max_coeff": 10.0},
        [{"lr": 0.05}, {"lr": 0.02, "weight_decay": 0.01, "max_grad_norm": 0.5}],
    ),
    (
        "OneBitLamb",
        {"freeze_step": 20, "bias_correction": False, "min_coeff": 0.2, "max_coeff": 0.5},
        [{"lr": 0.05, "weight_decay": 0.1}, {"lr": 0.1}],
    ),
    (
        "OneBitLamb",
        {"freeze_step": 8, "coeff_beta": 0.5, "factor_threshold": 0.01, "factor_min": 0.95},
        [{"lr": 0.05}, {"lr": 0.05, "weight_decay": 0.01}],
    ),
]
_IDS = [f"{name}-{i}" for i, (name, _, _) in enumerate(_CASES)]


def _matches_reference_body(rank: int, world_size: int, *, case: int) -> None:
    name, hyper, groups = _CASES[case]
    ours = _run_ours(name, hyper, groups)
    # The reference spells the LAMB defaults it uses.
    reference_hyper = {"min_coeff": 0.01, "max_coeff": 10.0, "local_step_clipper": 16, **hyper}
    reference = _run_reference(_REFERENCES[name], reference_hyper, groups)
    for got, want in zip(ours, reference):
        torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-6)
    moved = sum((got - start).norm().item() for got, start in zip(ours, _params()))
    assert moved > 0.1  # the steps really moved the parameters


@pytest.mark.parametrize("case", range(len(_CASES)), ids=_IDS)
def test_matches_reference_without_process_group(case: int) -> None:
    _matches_reference_body(0, 1, case=case)


@pytest.mark.parametrize("case", range(len(_CASES)), ids=_IDS)
def test_matches_reference_on_a_group_of_one(case: int) -> None:
    run_on_ranks(_matches_reference_body, 1, case=case)


@pytest.mark.parametrize("adam_w", [False, True])
def test_onebit_adam_warmup_is_torch_adam(adam_w: bool) -> None:
    import ds_optim

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2))
    peer_model = copy.deepcopy(model)
    weight_decay = 0.1 if adam_w else 0.0
    ours = ds_optim.OneBitAdam(
        model.parameters(), lr=1e-2, freeze_step=100, weight_decay=weight_decay
    )
    peer_class = torch.optim.AdamW if adam_w else torch.optim.Adam
    peer = peer_class(peer_model.parameters(), lr=1e-2, weight_decay=weight_decay)
    x, y = torch.randn(64, 6), torch.randn(64, 2)
    for _ in range(100):
        for m, opt in ((model, ours), (peer_model, peer)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
    for got, want in zip(model.parameters(), peer_model.parameters()):
        assert ((got - want).norm() / want.norm()).item() < 1e-6
