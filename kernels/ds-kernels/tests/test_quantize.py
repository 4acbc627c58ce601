"""quantize_blockwise / dequantize_blockwise: error bound, Triton == reference, edge cases, size."""

from __future__ import annotations

import pytest
import torch

import ds_kernels

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BITS = [8, 4]


def _x(
    shape: int | tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen).reshape(-1)
    # Magnitudes from 1e-3 to 1e3 along the tensor, so that each block's scale matters.
    x = x * torch.logspace(-3, 3, steps=x.numel())
    return x.reshape(shape).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", [1, 63, 64, 1000])
def test_reference_round_trip_within_half_a_scale(bits: int, dtype: torch.dtype, n: int) -> None:
    block = 32
    x = _x(n, dtype)
    q, scales = ds_kernels.quantize_blockwise(x, bits=bits, block_size=block)

    assert scales.dtype == torch.float32 and scales.shape == (-(-n // block),)
    assert q.dtype == (torch.int8 if bits == 8 else torch.uint8)
    out = ds_kernels.dequantize_blockwise(q, scales, bits=bits, block_size=block, shape=(n,))
    per_elem = scales.repeat_interleave(block)[:n]
    err = (out - x.float()).abs()
    # Half a step, plus float32 rounding of x / scale and code * scale.
    assert (err <= per_elem / 2 * (1 + 1e-5) + 1e-30).all(), (err / per_elem).max()
    # The codes use the whole range: each block's absmax maps to +-qmax.
    qmax = 127 if bits == 8 else 7
    torch.testing.assert_close(scales.max(), x.float().abs().max() / qmax, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize(("n", "block"), [(1, 2), (1000, 64), (4097, 256), (96, 32)])
def test_triton_matches_reference_bit_for_bit(
    triton_device: torch.device, bits: int, dtype: torch.dtype, n: int, block: int
) -> None:
    x = _x(n, dtype, triton_device)

    ref = ds_kernels.quantize_blockwise_reference(x.cpu(), bits=bits, block_size=block)
    got = ds_kernels.quantize_blockwise(x, bits=bits, block_size=block, backend="triton")

    assert torch.equal(got.q.cpu(), ref.q)
    assert torch.equal(got.scales.cpu(), ref.scales)
    kw = {"bits": bits, "block_size": block, "shape": (n,), "dtype": dtype}
    deq_ref = ds_kernels.dequantize_blockwise_reference(ref.q, ref.scales, **kw)
    deq = ds_kernels.dequantize_blockwise(got.q, got.scales, **kw, backend="triton")
    if dtype == torch.bfloat16:
        # The interpreter's float32 -> bfloat16 cast can differ from torch's by one ulp.
        torch.testing.assert_close(deq.cpu(), deq_ref)
    else:
        assert torch.equal(deq.cpu(), deq_ref)


def test_int4_packs_two_codes_per_byte_low_nibble_first() -> None:
    x = torch.tensor([7.0, -7.0, 1.0, -1.0])
    q, scales = ds_kernels.quantize_blockwise(x, bits=4, block_size=4)
    assert scales.tolist() == [1.0]
    # 7 | (-7 & 0xF) << 4 = 0x97; 1 | (-1 & 0xF) << 4 = 0xF1
    assert q.tolist() == [0x97, 0xF1]


@pytest.mark.parametrize("bits", BITS)
def test_all_zero_block_has_zero_scale_and_dequantizes_to_zero(bits: int) -> None:
    x = torch.cat([torch.zeros(32), torch.ones(32)])
    q, scales = ds_kernels.quantize_blockwise(x, bits=bits, block_size=32)
    assert scales[0] == 0.0
    out = ds_kernels.dequantize_blockwise(q, scales, bits=bits, block_size=32, shape=(64,))
    assert torch.equal(out, x)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("bits", BITS)
def test_non_finite_poisons_only_its_block(bits: int, bad: float) -> None:
    x = torch.linspace(-1, 1, 64)
    x[3] = bad
    q, scales = ds_kernels.quantize_blockwise(x, bits=bits, block_size=32)
    assert scales[0].isnan() and scales[1].isfinite()
    out = ds_kernels.dequantize_blockwise(q, scales, bits=bits, block_size=32, shape=(64,))
    assert out[:32].isnan().all()
    assert (out[32:] - x[32:]).abs().max() <= scales[1] / 2 * (1 + 1e-5)


@pytest.mark.parametrize("bits", BITS)
def test_non_finite_same_on_triton(triton_device: torch.device, bits: int) -> None:
    x = torch.linspace(-1, 1, 96)
    x[3], x[40] = float("nan"), float("inf")
    x = x.to(triton_device)
    ref = ds_kernels.quantize_blockwise_reference(x.cpu(), bits=bits, block_size=32)
    got = ds_kernels.quantize_blockwise(x, bits=bits, block_size=32, backend="triton")
    assert torch.equal(got.q.cpu(), ref.q)
    torch.testing.assert_close(got.scales.cpu(), ref.scales, equal_nan=True, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bits", BITS)
def test_empty_tensor(request: pytest.FixtureRequest, backend: str, bits: int) -> None:
    device = request.getfixturevalue("triton_device") if backend == "triton" else "cpu"
    x = torch.empty(0, device=device)
    q, scales = ds_kernels.quantize_blockwise(x, bits=bits, block_size=32, backend=backend)  # type: ignore[arg-type]
    assert q.numel() == 0 and scales.numel() == 0
    out = ds_kernels.dequantize_blockwise(
        q,
        scales,
        bits=bits,
        block_size=32,
        shape=(0,),
        backend=backend,  # type: ignore[arg-type]
    )
    assert out.shape == (0,)


def test_shape_restores_multidimensional_input() -> None:
    x = _x((3, 5, 7), torch.float32)
    q, scales = ds_kernels.quantize_blockwise(x, block_size=16)
    assert q.numel() == 112  # 105 elements padded to 7 blocks of 16
    out = ds_kernels.dequantize_blockwise(q, scales, block_size=16, shape=x.shape)
    assert out.shape == x.shape
    torch.testing.assert_close(out, x, atol=float(scales.max()) / 2, rtol=0)


@pytest.mark.parametrize(
    ("bits", "block", "min_vs_fp32", "min_vs_bf16"),
    [(8, 64, 3.7, 1.8), (8, 256, 3.9, 1.9), (4, 64, 7.1, 3.5), (4, 256, 7.7, 3.8)],
)
def test_wire_size_cuts_fp32_bytes_at_least_3x(
    bits: int, block: int, min_vs_fp32: float, min_vs_bf16: float
) -> None:
    n = 1 << 20
    x = torch.randn(n)
    q, scales = ds_kernels.quantize_blockwise(x, bits=bits, block_size=block)
    wire = q.numel() * q.element_size() + scales.numel() * scales.element_size()
    assert wire == ds_kernels.quantized_nbytes(n, bits=bits, block_size=block)
    assert n * 4 / wire >= min_vs_fp32 >= 3.0
    assert n * 2 / wire >= min_vs_bf16


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"bits": 3}, ValueError, "bits must be 8 or 4, got 3"),
        ({"block_size": 48}, ValueError, "power of two from 2 to 65536, got 48"),
        ({"block_size": 1}, ValueError, "power of two"),
        ({"symmetric": False}, ValueError, "symmetric=False .* not implemented"),
    ],
)
def test_quantize_rejects_bad_arguments(kwargs: dict, err: type, match: str) -> None:
    with pytest.raises(err, match=match):
        ds_kernels.quantize_blockwise(torch.ones(4), **kwargs)


def test_quantize_rejects_integer_input() -> None:
    with pytest.raises(TypeError, match=r"float32, float16 or bfloat16 tensor, got torch\.int64"):
        ds_kernels.quantize_blockwise(torch.arange(4))


def test_dequantize_rejects_mismatches() -> None:
    q, scales = ds_kernels.quantize_blockwise(torch.ones(64), block_size=32)
    with pytest.raises(TypeError, match=r"bits=4 needs torch\.uint8 codes"):
        ds_kernels.dequantize_blockwise(q, scales, bits=4, block_size=32)
    with pytest.raises(ValueError, match="need 128 code bytes, got 64"):
        ds_kernels.dequantize_blockwise(q, scales, block_size=64)
    with pytest.raises(ValueError, match=r"shape=\(10,\) holds 10 elements"):
        ds_kernels.dequantize_blockwise(q, scales, block_size=32, shape=(10,))
    with pytest.raises(TypeError, match="dtype must be float32"):
        ds_kernels.dequantize_blockwise(q, scales, block_size=32, dtype=torch.float64)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_ties_round_half_to_even(request: pytest.FixtureRequest, backend: str) -> None:
    device = request.getfixturevalue("triton_device") if backend == "triton" else "cpu"
    # absmax 127 makes the int8 scale exactly 1, so these land on ties.
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5], device=device)
    q, scales = ds_kernels.quantize_blockwise(x, block_size=8, backend=backend)  # type: ignore[arg-type]
    assert scales.tolist() == [1.0]
    assert q.tolist() == [127, 0, 2, 2, 0, -2, -2, 126]


def test_non_contiguous_input_runs_the_reference() -> None:
    x = _x((16, 8), torch.float32).t()
    assert not x.is_contiguous()
    q, scales = ds_kernels.quantize_blockwise(x, block_size=32)
    ref = ds_kernels.quantize_blockwise_reference(x.contiguous(), block_size=32)
    assert torch.equal(q, ref.q) and torch.equal(scales, ref.scales)
    out = ds_kernels.dequantize_blockwise(q, scales, block_size=32, shape=x.shape)
    torch.testing.assert_close(out, x, atol=float(scales.max()) / 2, rtol=0)
