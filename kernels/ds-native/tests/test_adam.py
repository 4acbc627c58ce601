"""adam_step's C kernel against its torch reference, on every code path this CPU runs.

Results are compared within 1e-6 of the tensor's scale: the vector paths fuse multiply-adds, so
they differ from the reference (and from each other) by rounding, and an element that cancels to
near zero has no meaningful relative error of its own. Conversions (16-bit grads in, the 16-bit
copy out) are exact and compared bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import ds_native
from ds_native import _ext

PATHS = ("scalar", "avx2", "avx512")


def _supported(path: str) -> bool:
    lib = _ext.EXTENSION.lib
    if lib is None:
        return False
    code = getattr(lib, f"DS_NATIVE_ADAM_{path.upper()}")
    return bool(lib.ds_native_adam_simd_supported(code))


simd_paths = pytest.mark.parametrize(
    "simd",
    [
        pytest.param(p, marks=pytest.mark.skipif(not _supported(p), reason=f"CPU lacks {p}"))
        for p in PATHS
    ],
)


def _tensors(
    n: int, seed: int, grad_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen).to(grad_dtype)
    exp_avg = torch.randn(n, generator=gen) * 0.1
    exp_avg_sq = torch.rand(n, generator=gen) * 0.01
    return param, grad, exp_avg, exp_avg_sq


def _clones(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.clone() for t in tensors)


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * scale)


def _assert_same_update(ours: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> None:
    for i in (0, 2, 3):  # param, exp_avg, exp_avg_sq
        assert_close_to_scale(ours[i], ref[i])


@simd_paths
@pytest.mark.parametrize("n", [0, 1, 7, 8, 15, 16, 17, 31, 33, 1000, 2 * 32768 + 5])
def test_matches_reference_on_every_length(simd: str, n: int) -> None:
    ours = _tensors(n, seed=n)
    ref = _clones(ours)
    kwargs = {"step": 3, "lr": 1e-2, "weight_decay": 0.1}

    assert ds_native.adam_step(*ours, **kwargs, simd=simd, num_threads=2) == simd
    ds_native.adam_step_reference(*ref, **kwargs)

    _assert_same_update(ours, ref)


@simd_paths
@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_matches_reference_in_every_mode(
    simd: str, adamw_mode: bool, weight_decay: float, bias_correction: bool
) -> None:
    ours = _tensors(1001, seed=1)
    ref = _clones(ours)
    kwargs = {
        "lr": 3e-3,
        "betas": (0.8, 0.99),
        "eps": 1e-6,
        "weight_decay": weight_decay,
        "adamw_mode": adamw_mode,
        "bias_correction": bias_correction,
    }
    for step in range(1, 6):
        ds_native.adam_step(*ours, step=step, **kwargs, simd=simd)
        ds_native.adam_step_reference(*ref, step=step, **kwargs)

    _assert_same_update(ours, ref)


def test_first_step_by_hand() -> None:
    # One step from zero moments, in float64: m = (1-b1) g, v = (1-b2) g^2, and with bias
    # correction the update is lr * g / (|g| + eps) (AdamW decay applied to p first).
    p, g = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.5, 0.25, -4.0])
    m, v = torch.zeros(3), torch.zeros(3)
    lr, eps, wd = 0.1, 1e-8, 0.01
    expected = p.double() * (1 - lr * wd) - lr * g.double() / (g.double().abs() + eps)

    ds_native.adam_step(p, g, m, v, step=1, lr=lr, eps=eps, weight_decay=wd)

    torch.testing.assert_close(p, expected.float())
    torch.testing.assert_close(m, 0.1 * g)
    torch.testing.assert_close(v, 0.001 * g * g)


@simd_paths
@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16])
def test_16bit_grads_match_reference(simd: str, grad_dtype: torch.dtype) -> None:
    ours = _tensors(4099, seed=2, grad_dtype=grad_dtype)
    ref = _clones(ours)

    ds_native.adam_step(*ours, step=2, lr=1e-2, simd=simd)
    ds_native.adam_step_reference(*ref, step=2, lr=1e-2)

    _assert_same_update(ours, ref)


@simd_paths
@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16])
def test_every_16bit_grad_converts_exactly(simd: str, grad_dtype: torch.dtype) -> None:
    # All 65536 bit patterns (inf and NaN included). From zero moments at beta1 = 0 and
    # beta2 = 0 the new moments are exactly g and g*g, so they show the conversion itself.
    grad = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(grad_dtype)
    n = grad.numel()
    p, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)

    ds_native.adam_step(p, grad, m, v, step=1, lr=0.0, betas=(0.0, 0.0), simd=simd)

    torch.testing.assert_close(m, grad.float(), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v, grad.float() ** 2, rtol=0, atol=0, equal_nan=True)


@simd_paths
@pytest.mark.parametrize("copy_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 15, 17, 300_001])
def test_copy_out_equals_cast_of_updated_param(simd: str, copy_dtype: torch.dtype, n: int) -> None:
    # 300_001 elements take the streaming-store path for the copy.
    ours = _tensors(n, seed=3)
    ref = _clones(ours)
    copy = torch.full((n,), 7.0, dtype=copy_dtype)

    ds_native.adam_step(*ours, step=1, lr=1e-2, param_copy=copy, simd=simd)
    ds_native.adam_step_reference(*ref, step=1, lr=1e-2)

    assert torch.equal(copy, ours[0].to(copy_dtype))
    _assert_same_update(ours, ref)


def _rounding_cases() -> torch.Tensor:
    """fp32 values at the edges of fp16/bf16 rounding: ties, subnormals, overflow, specials."""
    bits = [
        0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001, 0x807FFFFF,
        0x33000000, 0x33000001, 0x337FFFFF, 0x33800000, 0x387FC000, 0x387FE000, 0x38800000,
        0x477FE000, 0x477FEFFF, 0x477FF000, 0x47800000, 0x7F7FFFFF, 0x3F808000, 0x3F818000,
        0x3F800FFF, 0x3F801000, 0x3F803000, 0x3F807FFF, 0x3F80FFFF, 0x7F7F8000, 0x7F7FC000,
    ]  # fmt: skip
    gen = torch.Generator().manual_seed(4)
    random = torch.randint(0, 2**32, (20000,), generator=gen, dtype=torch.int64)
    finite = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    values = torch.cat([finite, random.to(torch.int32).view(torch.float32)])
    return values[~values.isnan()]


@simd_paths
@pytest.mark.parametrize("copy_dtype", [torch.float16, torch.bfloat16])
def test_copy_out_rounds_like_torch(simd: str, copy_dtype: torch.dtype) -> None:
    # lr = 0 and zero grads leave param exactly as it was, so the copy shows the rounding alone.
    param = _rounding_cases()
    n = param.numel()
    zeros = torch.zeros(n)
    copy = torch.empty(n, dtype=copy_dtype)

    ds_native.adam_step(
        param.clone(), zeros, zeros.clone(), zeros.clone(), step=1, lr=0.0, param_copy=copy,
        simd=simd,
    )  # fmt: skip

    expected = param.to(copy_dtype)
    assert torch.equal(copy.view(torch.int16), expected.view(torch.int16))


@simd_paths
@pytest.mark.parametrize("copy_dtype", [torch.float16, torch.bfloat16])
def test_copy_out_of_nan_is_nan(simd: str, copy_dtype: torch.dtype) -> None:
    param = torch.tensor([float("nan"), -float("nan"), 1.0] * 7)
    zeros = torch.zeros_like(param)
    copy = torch.zeros(param.numel(), dtype=copy_dtype)
    ds_native.adam_step(
        param, zeros, zeros.clone(), zeros.clone(), step=1, lr=0.0, param_copy=copy, simd=simd
    )
    torch.testing.assert_close(copy, param.to(copy_dtype), equal_nan=True)


@simd_paths
def test_paths_agree_within_rounding(simd: str) -> None:
    scalar = _tensors(5000, seed=5)
    other = _clones(scalar)
    ds_native.adam_step(*scalar, step=7, lr=1e-3, simd="scalar")
    ds_native.adam_step(*other, step=7, lr=1e-3, simd=simd)
    _assert_same_update(other, scalar)


@pytest.mark.parametrize("num_threads", [2, 3, 8])
def test_thread_count_does_not_change_results(num_threads: int) -> None:
    one = _tensors(5 * 32768 + 11, seed=6)
    many = _clones(one)
    copies = [torch.empty(one[0].numel(), dtype=torch.bfloat16) for _ in range(2)]

    ds_native.adam_step(*one, step=4, lr=1e-3, param_copy=copies[0], num_threads=1)
    ds_native.adam_step(*many, step=4, lr=1e-3, param_copy=copies[1], num_threads=num_threads)

    for a, b in zip(one, many):
        assert torch.equal(a, b)
    assert torch.equal(copies[0], copies[1])


def test_multidimensional_and_offset_views() -> None:
    # Contiguous views at an odd element offset: nothing is 16- or 64-byte aligned.
    storage = [torch.randn(3 * 5 * 7 + 1) for _ in range(4)]
    ours = tuple(s[1:].view(3, 5, 7) for s in storage)
    ours[3].abs_()
    ref = _clones(ours)
    copy = torch.empty(3 * 5 * 7 + 1, dtype=torch.float16)[1:].view(3, 5, 7)

    ds_native.adam_step(*ours, step=2, lr=1e-2, param_copy=copy, backend="native")
    ds_native.adam_step_reference(*ref, step=2, lr=1e-2)

    _assert_same_update(ours, ref)
    assert torch.equal(copy, ours[0].half())


def test_many_steps_track_torch_adamw() -> None:
    gen = torch.Generator().manual_seed(7)
    init = torch.randn(4099, generator=gen)
    ref_param = torch.nn.Parameter(init.clone())
    ref = torch.optim.AdamW([ref_param], lr=1e-2, weight_decay=0.1, foreach=False)
    p, m, v = init.clone(), torch.zeros(4099), torch.zeros(4099)
    for step in range(1, 101):
        grad = torch.randn(4099, generator=gen)
        ref_param.grad = grad.clone()
        ref.step()
        ds_native.adam_step(p, grad, m, v, step=step, lr=1e-2, weight_decay=0.1)
    assert_close_to_scale(p, ref_param.detach())
    assert_close_to_scale(m, ref.state[ref_param]["exp_avg"])
    assert_close_to_scale(v, ref.state[ref_param]["exp_avg_sq"])


@simd_paths
def test_zero_and_infinite_denominators_divide_exactly(simd: str) -> None:
    # The vector paths multiply by a Newton-refined reciprocal ([Note: no division]); where the
    # denominator is 0 (eps = 0, v = 0) or inf, they must still give what division gives.
    n = 37  # a vector body and a tail
    m = torch.zeros(n)
    m[1::3] = 1.0
    grad = torch.zeros(n)
    grad[2::3] = float("inf")
    p, v = torch.zeros(n), torch.zeros(n)
    ref = (p.clone(), grad.clone(), m.clone(), v.clone())

    ds_native.adam_step(p, grad, m, v, step=1, lr=1.0, eps=0.0, simd=simd)
    ds_native.adam_step_reference(*ref, step=1, lr=1.0, eps=0.0)

    assert p[1].item() == float("-inf")  # x / 0
    assert p[0].isnan() and p[2].isnan()  # 0 / 0 and inf / inf
    torch.testing.assert_close(p, ref[0], rtol=0, atol=0, equal_nan=True)
