"""The Triton kernels on the GPU at training sizes (``pytest -m gpu``; skipped without CUDA).

The interpreter tests use a few thousand elements; here Adam runs on tensors of millions of
elements in every dtype, and MoE dispatch/combine on thousands of tokens, each against its torch
reference on the same device.
"""

from __future__ import annotations

import pytest
import torch

import ds_kernels

# ds-kernels' tests run without ds-testing's plugin, so the skip is explicit here.
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


def _adam_state(numels: list[int], dtype: torch.dtype) -> list[list[torch.Tensor]]:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def make(n: int, dt: torch.dtype, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(n, device="cuda", generator=gen) * scale).to(dt)

    state_dtype = torch.float32
    params = [make(n, dtype) for n in numels]
    grads = [make(n, dtype) for n in numels]
    exp_avgs = [make(n, state_dtype, 0.1) for n in numels]
    exp_avg_sqs = [make(n, state_dtype, 1e-3).abs() for n in numels]
    return [params, grads, exp_avgs, exp_avg_sqs]


# A low-precision param may round one ulp apart from the reference (the kernel's fp32 math runs in
# another order); each step is compared from the same state, so ulps never compound.
ADAM_TOLERANCE = {
    torch.float32: {"rtol": 1e-6, "atol": 1e-7},
    torch.float16: {"rtol": 2**-9, "atol": 1e-5},
    torch.bfloat16: {"rtol": 2**-7, "atol": 1e-5},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_adam_at_training_size_matches_the_reference(dtype: torch.dtype) -> None:
    numels = [(1 << 22) + 3, 1 << 20, 7, (3 << 18) + 1]
    kernel = _adam_state(numels, dtype)
    for step in (1, 2, 3):
        reference = [[t.clone() for t in ts] for ts in kernel]
        ds_kernels.adam(*kernel, step=step, **HYPER, adam_w_mode=True, backend="triton")
        ds_kernels.adam_reference(*reference, step=step, **HYPER, adam_w_mode=True)
        for got_list, want_list in zip(kernel, reference):
            for got, want in zip(got_list, want_list):
                torch.testing.assert_close(got, want, **ADAM_TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_moe_routing_at_training_size_matches_the_reference(dtype: torch.dtype) -> None:
    tokens, k, slots, hidden = 4096, 2, 6144, 1024
    gen = torch.Generator().manual_seed(0)
    flat = torch.full((tokens * k,), -1, dtype=torch.int64)
    taken = torch.randperm(tokens * k, generator=gen)[:slots]
    flat[taken] = torch.randperm(slots, generator=gen)
    slot_token = torch.full((slots,), -1, dtype=torch.int64)
    slot_token[flat[taken]] = taken // k
    token_slot, slot_token = flat.view(tokens, k).cuda(), slot_token.cuda()
    x = torch.randn(tokens, hidden, generator=gen).to(device="cuda", dtype=dtype)
    expert_out = torch.randn(slots, hidden, generator=gen).to(device="cuda", dtype=dtype)
    token_w = torch.rand(tokens, k, generator=gen).cuda()
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype != torch.float32 else {}

    got = ds_kernels.moe_dispatch(x, slot_token, backend="triton")
    want = ds_kernels.moe_dispatch_reference(x.float(), slot_token).to(dtype)
    torch.testing.assert_close(got, want, **tol)
    got = ds_kernels.moe_combine(expert_out, token_slot, token_w, backend="triton")
    want = ds_kernels.moe_combine_reference(expert_out.float(), token_slot, token_w).to(dtype)
    torch.testing.assert_close(got, want, **tol)
