"""adam: the multi-tensor Triton kernel against the torch reference, the reference against
torch.optim, dispatch and argument errors."""

from __future__ import annotations

import pytest
import torch

import ds_kernels
from ds_kernels import _adam

HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
# Odd sizes cross chunk boundaries; the 0-element tensor has no chunk at all.
SHAPES = [(1,), (1000,), (1025,), (3, 5, 7), (0,), (2048,)]


def _state(
    shapes: list[tuple[int, ...]], dtype: torch.dtype, device: torch.device, seed: int = 0
) -> tuple[list[torch.Tensor], ...]:
    gen = torch.Generator().manual_seed(seed)
    state_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype

    def make(shape: tuple[int, ...], dt: torch.dtype, positive: bool = False) -> torch.Tensor:
        t = torch.randn(shape, generator=gen)
        return (t.abs() * 1e-3 if positive else t).to(device=device, dtype=dt)

    params = [make(s, dtype) for s in shapes]
    grads = [make(s, dtype) for s in shapes]
    exp_avgs = [make(s, state_dtype) * 0.1 for s in shapes]
    exp_avg_sqs = [make(s, state_dtype, positive=True) for s in shapes]
    return params, grads, exp_avgs, exp_avg_sqs


def _clone(lists: tuple[list[torch.Tensor], ...]) -> tuple[list[torch.Tensor], ...]:
    return tuple([t.clone() for t in ts] for ts in lists)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("adam_w_mode", "weight_decay", "bias_correction"),
    [(True, 0.0, True), (True, 0.1, True), (False, 0.1, True), (False, 0.0, False)],
)
def test_triton_matches_reference_over_steps(
    triton_device: torch.device,
    dtype: torch.dtype,
    adam_w_mode: bool,
    weight_decay: float,
    bias_correction: bool,
) -> None:
    kernel_state = _state(SHAPES, dtype, triton_device)
    reference_state = _clone(kernel_state)
    options = {"adam_w_mode": adam_w_mode, "weight_decay": weight_decay}
    options["bias_correction"] = bias_correction

    tol = {"rtol": 1e-6, "atol": 1e-7} if dtype == torch.float32 else {}
    for step in (1, 2, 3):
        ds_kernels.adam(*kernel_state, step=step, **HYPER, **options, backend="triton")
        ds_kernels.adam_reference(*reference_state, step=step, **HYPER, **options)
        for got, want in zip(kernel_state, reference_state):
            torch.testing.assert_close(got, want, **tol)
        # Triton's CPU interpreter rounds fp32 -> bf16 toward zero (CUDA rounds to nearest), so
        # bf16 params may differ by an ulp per step: compare each step, then start level again.
        torch._foreach_copy_(kernel_state[0], reference_state[0])


def test_triton_leaves_grads_alone(triton_device: torch.device) -> None:
    params, grads, exp_avgs, exp_avg_sqs = _state(SHAPES, torch.float32, triton_device)
    before = [g.clone() for g in grads]
    ds_kernels.adam(params, grads, exp_avgs, exp_avg_sqs, step=1, **HYPER, backend="triton")
    torch.testing.assert_close(grads, before, rtol=0, atol=0)


def test_triton_reuses_cached_chunk_tables(triton_device: torch.device) -> None:
    shapes = [(7,), (3000,)]
    _adam._chunk_tables.cache_clear()
    for step in (1, 2):
        # Fresh tensors each step (new addresses), same sizes: one table built, then reused.
        ds_kernels.adam(
            *_state(shapes, torch.float32, triton_device), step=step, **HYPER, backend="triton"
        )
    info = _adam._chunk_tables.cache_info()
    assert (info.misses, info.hits) == (1, 1)


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_reference_matches_torch_optim(adam_w_mode: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    params = [torch.randn(s, generator=gen, dtype=dtype) for s in [(5, 3), (17,)]]
    torch_params = [p.clone().requires_grad_() for p in params]
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    opt = torch_cls(torch_params, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)
    exp_avgs = [torch.zeros_like(p) for p in params]
    exp_avg_sqs = [torch.zeros_like(p) for p in params]

    for step in range(1, 21):
        grads = [torch.randn(p.shape, generator=gen, dtype=dtype) for p in params]
        for p, g in zip(torch_params, grads):
            p.grad = g.clone()
        opt.step()
        ds_kernels.adam_reference(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            step=step,
            lr=1e-2,
            beta1=0.8,
            beta2=0.99,
            eps=1e-6,
            weight_decay=0.05,
            adam_w_mode=adam_w_mode,
        )

    torch.testing.assert_close(params, [p.detach() for p in torch_params], rtol=1e-6, atol=1e-7)


def test_reference_low_precision_params_use_fp32_math() -> None:
    p = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)
    g = torch.tensor([0.5, 0.25], dtype=torch.bfloat16)
    m, v = torch.zeros(2), torch.zeros(2)
    ds_kernels.adam_reference([p], [g], [m], [v], step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=0)
    # First bias-corrected step moves each element by lr * sign(g); the moments stay fp32.
    assert p.tolist() == [0.8984375, -2.09375]  # 0.9 and -2.1 rounded to bf16
    torch.testing.assert_close(m, torch.tensor([0.05, 0.025]))
    assert m.dtype == v.dtype == torch.float32


def test_docstring_example() -> None:
    p, g = torch.ones(4), torch.full((4,), 0.5)
    m, v = torch.zeros(4), torch.zeros(4)
    ds_kernels.adam([p], [g], [m], [v], step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8)
    torch.testing.assert_close(p, torch.full((4,), 0.9))


def test_cpu_tensors_get_the_reference_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    launches: list[int] = []
    monkeypatch.setattr(_adam, "_launch", lambda *args: launches.append(1))
    params, grads, exp_avgs, exp_avg_sqs = _state([(8,)], torch.float32, torch.device("cpu"))
    before = params[0].clone()
    ds_kernels.adam(params, grads, exp_avgs, exp_avg_sqs, step=1, **HYPER)
    assert launches == []
    assert not torch.equal(params[0], before)


def test_forced_triton_refuses_float64(triton_device: torch.device) -> None:
    lists = _state([(8,)], torch.float64, triton_device)
    with pytest.raises(ValueError, match=r"adam\(backend='triton'\).*got torch.float64"):
        ds_kernels.adam(*lists, step=1, **HYPER, backend="triton")


def test_empty_lists_are_a_no_op() -> None:
    lists: tuple[list[torch.Tensor], ...] = ([], [], [], [])
    assert ds_kernels.adam(*lists, step=1, **HYPER) is None
    assert ds_kernels.adam_reference(*lists, step=1, **HYPER) is None
    assert lists == ([], [], [], [])
    with pytest.raises(ValueError, match="step must be an int >= 1"):
        ds_kernels.adam(*lists, step=0, **HYPER)  # the arguments are still checked


def _bad_lists(kind: str) -> tuple[list[torch.Tensor], ...]:
    p, g, m, v = ([t] for t in (torch.ones(4), torch.ones(4), torch.zeros(4), torch.zeros(4)))
    if kind == "length":
        g = [*g, torch.ones(4)]
    elif kind == "grad_shape":
        g = [torch.ones(5)]
    elif kind == "state_dtype":
        p, g = [torch.ones(4, dtype=torch.bfloat16)], [torch.ones(4, dtype=torch.bfloat16)]
        m = [torch.zeros(4, dtype=torch.bfloat16)]
    elif kind == "mixed":
        p = [*p, torch.ones(2, dtype=torch.float64)]
        g = [*g, torch.ones(2, dtype=torch.float64)]
        m, v = [*m, torch.zeros(2)], [*v, torch.zeros(2)]
    elif kind == "integer":
        p, g = [torch.ones(4, dtype=torch.int32)], [torch.ones(4, dtype=torch.int32)]
        m, v = [torch.zeros(4, dtype=torch.int32)], [torch.zeros(4, dtype=torch.int32)]
    return p, g, m, v


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("length", "same length, got 1, 2, 1 and 1"),
        ("grad_shape", r"grads\[0\] must have shape \(4,\).*got \(5,\)"),
        ("state_dtype", r"exp_avgs\[0\] must have .*dtype torch.float32.*got .*torch.bfloat16"),
        ("mixed", r"one device and dtype \(group them first\).*params\[1\]"),
        ("integer", "params must be floating point, got torch.int32"),
    ],
)
def test_argument_errors(kind: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ds_kernels.adam(*_bad_lists(kind), step=1, **HYPER)


@pytest.mark.parametrize("step", [0, -1, 1.0, True])
def test_step_must_be_a_positive_int(step: object) -> None:
    lists = _state([(4,)], torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="step must be an int >= 1"):
        ds_kernels.adam(*lists, step=step, **HYPER)  # type: ignore[arg-type]
