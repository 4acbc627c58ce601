"""CPUAdam against torch.optim.Adam/AdamW: parity, fused copy-out, param groups, state dicts.

"Within 1e-6 relative" is measured against each tensor's scale (rtol 1e-6, atol 1e-6 * max|x|):
CPUAdam fuses multiply-adds and multiplies by 1/sqrt(1 - beta2^t) where torch divides, so an
element that cancels to near zero differs from torch's in its last bits, as torch's own fused
and for-loop Adams differ from each other.
"""

from __future__ import annotations

import copy

import pytest
import torch

import ds_optim


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * scale)


def _pair(shapes: list[tuple[int, ...]], seed: int = 0) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(seed)
    inits = [torch.randn(shape, generator=gen) for shape in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in inits]
    theirs = [torch.nn.Parameter(t.clone()) for t in inits]
    return ours, theirs


def _train(ours: torch.optim.Optimizer, theirs: torch.optim.Optimizer, steps: int) -> None:
    """``steps`` steps of both with the same random grads."""
    gen = torch.Generator().manual_seed(1)
    params = [p for g in ours.param_groups for p in g["params"]]
    ref_params = [p for g in theirs.param_groups for p in g["params"]]
    for _ in range(steps):
        for p, q in zip(params, ref_params):
            grad = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = grad.clone(), grad.clone()
        ours.step()
        theirs.step()


SHAPES = [[(1,)], [(7,), (33, 17)], [(2, 3, 5), (4099,), (64, 65)]]


@pytest.mark.parametrize("shapes", SHAPES, ids=["1", "7+33x17", "mixed"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam"])
def test_matches_torch_over_100_steps(
    shapes: list[tuple[int, ...]], weight_decay: float, adamw_mode: bool
) -> None:
    ours, theirs = _pair(shapes)
    opt = ds_optim.CPUAdam(ours, lr=1e-2, weight_decay=weight_decay, adamw_mode=adamw_mode)
    torch_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref = torch_cls(theirs, lr=1e-2, weight_decay=weight_decay, foreach=False)

    _train(opt, ref, steps=100)

    for p, q in zip(ours, theirs):
        assert_close_to_scale(p.detach(), q.detach())
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close_to_scale(opt.state[p][key], ref.state[q][key])
        assert opt.state[p]["step"] == ref.state[q]["step"] == 100


def test_per_group_hyperparameters() -> None:
    ours, theirs = _pair([(50,), (60,)])
    groups = lambda ps: [  # noqa: E731
        {"params": [ps[0]], "lr": 1e-2, "betas": (0.8, 0.95), "weight_decay": 0.2},
        {"params": [ps[1]], "eps": 1e-5},
    ]
    opt = ds_optim.CPUAdam(groups(ours), lr=3e-3, weight_decay=0.01)
    ref = torch.optim.AdamW(groups(theirs), lr=3e-3, weight_decay=0.01, foreach=False)

    _train(opt, ref, steps=20)

    for p, q in zip(ours, theirs):
        assert_close_to_scale(p.detach(), q.detach())


def test_without_bias_correction_by_hand() -> None:
    # bias_correction=False: the first step is lr * m / (sqrt(v) + eps) with m = (1-b1) g and
    # v = (1-b2) g^2, i.e. lr * 0.1 g / (sqrt(0.001) |g| + eps).
    param = torch.nn.Parameter(torch.tensor([1.0, -1.0, 2.0]))
    grad = torch.tensor([0.5, -2.0, 1e-3])
    param.grad = grad.clone()
    opt = ds_optim.CPUAdam([param], lr=0.1, bias_correction=False)

    opt.step()

    g = grad.double()
    expected = torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64) - 0.1 * 0.1 * g / (
        0.001**0.5 * g.abs() + 1e-8
    )
    torch.testing.assert_close(param.detach(), expected.float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("form", ["nested", "flat", "tensor"], ids=["[[t]]", "[t]", "t"])
def test_fused_copy_out_matches_cast(dtype: torch.dtype, form: str) -> None:
    (param,), _ = _pair([(33, 17)])
    param.grad = torch.randn(33, 17)
    copy = torch.zeros(33 * 17, dtype=dtype)  # a flat partition, as ZeRO-Offload keeps them
    targets = {"nested": [[copy]], "flat": [copy], "tensor": copy}[form]
    opt = ds_optim.CPUAdam([param], lr=1e-2)

    for _ in range(3):
        opt.step(fp16_param_groups=targets)
        assert torch.equal(copy, param.detach().reshape(-1).to(dtype))


def test_copy_out_skips_params_without_grad_and_keeps_indices() -> None:
    params, _ = _pair([(5,), (6,), (7,)])
    params[0].grad, params[2].grad = torch.randn(5), torch.randn(7)
    copies = [torch.zeros(n, dtype=torch.bfloat16) for n in (5, 6, 7)]
    opt = ds_optim.CPUAdam(params, lr=0.1)

    opt.step(fp16_param_groups=[copies])

    assert torch.equal(copies[0], params[0].detach().bfloat16())
    assert torch.equal(copies[1], torch.zeros(6, dtype=torch.bfloat16))  # no grad: untouched
    assert torch.equal(copies[2], params[2].detach().bfloat16())


def test_copy_out_to_a_strided_target_copies_after_the_step() -> None:
    (param,), _ = _pair([(4, 6)])
    param.grad = torch.randn(4, 6)
    target = torch.zeros(6, 4, dtype=torch.bfloat16).t()  # not contiguous: not fused
    ds_optim.CPUAdam([param], lr=0.1).step(fp16_param_groups=target)
    assert torch.equal(target, param.detach().bfloat16())


@pytest.mark.parametrize(
    ("targets", "error", "match"),
    [
        ([[torch.zeros(5)]], TypeError, "must be float16 or bfloat16, got torch.float32"),
        ([[torch.zeros(4, dtype=torch.half)]], ValueError, "has 4 elements for a param of 5"),
        ([[]], ValueError, "no tensor for param 0 of group 0"),
    ],
)
def test_copy_out_errors(targets: list, error: type[Exception], match: str) -> None:
    param = torch.nn.Parameter(torch.zeros(5))
    param.grad = torch.ones(5)
    with pytest.raises(error, match=match):
        ds_optim.CPUAdam([param]).step(fp16_param_groups=targets)


def test_state_dict_has_torch_layout_and_loads_into_torch() -> None:
    ours, theirs = _pair([(10,), (3, 4)])
    opt = ds_optim.CPUAdam(ours, lr=1e-2, adamw_mode=False, weight_decay=0.1)
    ref = torch.optim.Adam(theirs, lr=1e-2, weight_decay=0.1, foreach=False)
    _train(opt, ref, steps=5)

    saved = copy.deepcopy(opt.state_dict())  # as if through a file: nothing shared
    assert set(saved["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    assert saved["state"][0]["step"].dtype == torch.float32
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    resumed = torch.optim.Adam(resumed_params, lr=1e-2, weight_decay=0.1, foreach=False)
    resumed.load_state_dict(saved)
    _train(opt, resumed, steps=5)

    for p, q in zip(ours, resumed_params):
        assert_close_to_scale(p.detach(), q.detach())


def test_loads_a_torch_adamw_state_dict_and_round_trips() -> None:
    ours, theirs = _pair([(10,), (3, 4)])
    ref = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    _train(torch.optim.AdamW(ours, lr=1e-2, foreach=False), ref, steps=5)

    opt = ds_optim.CPUAdam(ours, lr=1.0, weight_decay=0.5)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))
    assert opt.param_groups[0]["lr"] == 1e-2  # the saved hyperparameters win
    assert opt.param_groups[0]["adamw_mode"] is True  # missing keys take CPUAdam's defaults
    again = ds_optim.CPUAdam(ours)
    again.load_state_dict(copy.deepcopy(opt.state_dict()))
    _train(again, ref, steps=5)

    for p, q in zip(ours, theirs):
        assert_close_to_scale(p.detach(), q.detach())


def test_int_step_from_a_deepspeed_checkpoint() -> None:
    ours, theirs = _pair([(8,)])
    opt = ds_optim.CPUAdam(ours, lr=1e-2, weight_decay=0.01)
    ref = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)  # weight_decay=0.01 by default
    _train(opt, ref, steps=3)
    opt.state[ours[0]]["step"] = 3  # DeepSpeedCPUAdam keeps a Python int
    _train(opt, ref, steps=3)
    assert_close_to_scale(ours[0].detach(), theirs[0].detach())
    assert opt.state[ours[0]]["step"] == 6


@pytest.mark.parametrize("fp32_states", [True, False])
def test_bf16_params(fp32_states: bool) -> None:
    param = torch.nn.Parameter(torch.randn(100).bfloat16())
    master = torch.nn.Parameter(param.detach().float())
    grad = torch.randn(100)
    param.grad, master.grad = grad.bfloat16(), grad.bfloat16().float()
    opt = ds_optim.CPUAdam([param], lr=1e-2, fp32_optimizer_states=fp32_states)
    torch.optim.AdamW([master], lr=1e-2).step()

    opt.step()

    expected_state = torch.float32 if fp32_states else torch.bfloat16
    assert opt.state[param]["exp_avg"].dtype == expected_state
    assert param.dtype == torch.bfloat16
    torch.testing.assert_close(param.detach(), master.detach().bfloat16())


def test_closure_and_skipped_params() -> None:
    params, _ = _pair([(3,), (4,)])
    before = params[1].detach().clone()
    opt = ds_optim.CPUAdam(params, lr=0.1)

    def closure() -> torch.Tensor:
        loss = (params[0] ** 2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)

    assert loss.item() > 0
    assert torch.equal(params[1].detach(), before)  # no grad: no step, no state
    assert params[1] not in opt.state


def test_num_threads_does_not_change_results() -> None:
    ours, theirs = _pair([(200_003,)])
    opt = ds_optim.CPUAdam(ours, lr=1e-3, num_threads=1)
    other = ds_optim.CPUAdam(theirs, lr=1e-3, num_threads=3)
    _train(opt, other, steps=3)
    assert torch.equal(ours[0], theirs[0])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"amsgrad": True}, "amsgrad=True is not supported"),
        ({"lr": -1.0}, "lr must be a number >= 0"),
        ({"betas": (0.9, 1.0)}, r"betas must both be in \[0, 1\)"),
        ({"eps": float("inf")}, "eps must be finite"),
        ({"num_threads": 0}, "num_threads must be a positive int"),
    ],
)
def test_constructor_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ds_optim.CPUAdam([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_params_off_the_cpu_raise() -> None:
    param = torch.nn.Parameter(torch.zeros(2, device="meta"))
    param.grad = torch.zeros(2, device="meta")
    with pytest.raises(RuntimeError, match="params must be in CPU memory, got one on meta"):
        ds_optim.CPUAdam([param]).step()


def test_sparse_grads_raise() -> None:
    param = torch.nn.Parameter(torch.zeros(4))
    param.grad = torch.zeros(4).to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        ds_optim.CPUAdam([param]).step()
