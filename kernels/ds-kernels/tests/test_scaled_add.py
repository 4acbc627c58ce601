"""scaled_add: the Triton kernel (CUDA, or the interpreter on CPU) against the torch reference."""

from __future__ import annotations

import pytest
import torch

import ds_kernels

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _inputs(
    n: int | tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shape = (n,) if isinstance(n, int) else n
    x = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    y = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    return x, y


def _expected(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    # The kernel computes in fp32 and rounds once, as torch does on CUDA; torch on CPU rounds
    # fp16/bf16 intermediates, so a same-dtype CPU reference can differ by an ulp.
    return ds_kernels.scaled_add_reference(x.float(), y.float(), alpha).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 1000, 4097])
@pytest.mark.parametrize("alpha", [1.0, -0.5, 3])
def test_triton_matches_reference(
    triton_device: torch.device, n: int, dtype: torch.dtype, alpha: float
) -> None:
    x, y = _inputs(n, dtype, triton_device)

    out = ds_kernels.scaled_add(x, y, alpha, backend="triton")

    assert out.dtype == dtype and out.device == x.device and out.shape == x.shape
    torch.testing.assert_close(out, _expected(x, y, alpha))


def test_triton_on_multidimensional_tensor(triton_device: torch.device) -> None:
    x, y = _inputs((3, 5, 7), torch.float32, triton_device)
    out = ds_kernels.scaled_add(x, y, 0.25, backend="triton")
    torch.testing.assert_close(out, _expected(x, y, 0.25))


def test_triton_on_empty_tensor(triton_device: torch.device) -> None:
    x, y = _inputs(0, torch.float32, triton_device)
    assert ds_kernels.scaled_add(x, y, 2.0, backend="triton").shape == (0,)


def test_triton_leaves_inputs_alone(triton_device: torch.device) -> None:
    x, y = _inputs(100, torch.float32, triton_device)
    x0, y0 = x.clone(), y.clone()
    out = ds_kernels.scaled_add(x, y, 2.0, backend="triton")
    assert out.data_ptr() not in (x.data_ptr(), y.data_ptr())
    torch.testing.assert_close((x, y), (x0, y0), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64, torch.int32], ids=str)
def test_reference_on_cpu(dtype: torch.dtype) -> None:
    x = torch.arange(6).to(dtype)
    out = ds_kernels.scaled_add(x, x, 2)
    assert out.dtype == dtype
    torch.testing.assert_close(out, (torch.arange(6) * 3).to(dtype))
