"""moe_dispatch, moe_combine and moe_combine_weight_grad: the torch references against their
row-by-row definitions, the Triton kernels (CUDA, or the interpreter on CPU) against the
references, dispatch rules and argument errors."""

from __future__ import annotations

import pytest
import torch

import ds_kernels

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _routing(
    tokens: int, k: int, slots: int, seed: int = 0, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random routing: ``token_slot [tokens, k]`` (some dropped) and its inverse ``slot_token``."""
    gen = torch.Generator().manual_seed(seed)
    choices = min(tokens * k, slots)
    flat = torch.full((tokens * k,), -1, dtype=torch.int64)
    taken = torch.randperm(tokens * k, generator=gen)[: choices * 3 // 4]
    flat[taken] = torch.randperm(slots, generator=gen)[: taken.numel()]
    token_slot = flat.view(tokens, k)
    slot_token = torch.full((slots,), -1, dtype=torch.int64)
    slot_token[flat[taken]] = taken // k
    return token_slot.to(device), slot_token.to(device)


def _rows(n: int, hidden: int, dtype: torch.dtype, device, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, hidden, generator=gen).to(device=device, dtype=dtype)


def test_dispatch_reference_is_the_row_gather() -> None:
    tokens = _rows(7, 5, torch.float32, "cpu")
    _, slot_token = _routing(7, 2, 12)
    weight = torch.rand(12)
    out = ds_kernels.moe_dispatch_reference(tokens, slot_token, weight)
    for i, t in enumerate(slot_token.tolist()):
        want = torch.zeros(5) if t < 0 else tokens[t] * weight[i]
        torch.testing.assert_close(out[i], want)


def test_combine_references_are_the_weighted_sums() -> None:
    expert_out = _rows(12, 5, torch.float32, "cpu")
    token_slot, _ = _routing(7, 2, 12)
    weight = torch.rand(7, 2)
    grad = _rows(7, 5, torch.float32, "cpu", seed=2)
    out = ds_kernels.moe_combine_reference(expert_out, token_slot, weight)
    unweighted = ds_kernels.moe_combine_reference(expert_out, token_slot)
    wgrad = ds_kernels.moe_combine_weight_grad_reference(grad, expert_out, token_slot)
    for s in range(7):
        want, plain = torch.zeros(5), torch.zeros(5)
        for j, slot in enumerate(token_slot[s].tolist()):
            if slot >= 0:
                want += weight[s, j] * expert_out[slot]
                plain += expert_out[slot]
            expected_grad = torch.dot(grad[s], expert_out[slot]) if slot >= 0 else torch.tensor(0.0)
            torch.testing.assert_close(wgrad[s, j], expected_grad)
        torch.testing.assert_close(out[s], want)
        torch.testing.assert_close(unweighted[s], plain)


def test_combine_weight_grad_is_autograd_of_reference() -> None:
    expert_out = _rows(12, 5, torch.float32, "cpu").requires_grad_()
    token_slot, _ = _routing(7, 2, 12)
    weight = torch.rand(7, 2, requires_grad=True)
    grad = _rows(7, 5, torch.float32, "cpu", seed=2)
    ds_kernels.moe_combine_reference(expert_out, token_slot, weight).backward(grad)
    got = ds_kernels.moe_combine_weight_grad(grad, expert_out.detach(), token_slot)
    torch.testing.assert_close(got, weight.grad)


def _expected(fn, *args: torch.Tensor | None) -> torch.Tensor:
    """The reference on float32 copies: the kernels accumulate in float32 and round once."""
    wide = [a if a is None or not a.is_floating_point() else a.float() for a in args]
    return fn(*wide)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("tokens", "k", "slots", "hidden"), [(9, 1, 12, 16), (13, 2, 20, 33)])
@pytest.mark.parametrize("weighted", [False, True])
def test_triton_matches_reference(
    triton_device: torch.device,
    dtype: torch.dtype,
    tokens: int,
    k: int,
    slots: int,
    hidden: int,
    weighted: bool,
) -> None:
    token_slot, slot_token = _routing(tokens, k, slots, device=triton_device)
    x = _rows(tokens, hidden, dtype, triton_device)
    expert_out = _rows(slots, hidden, dtype, triton_device, seed=3)
    slot_w = torch.rand(slots).to(triton_device) if weighted else None
    token_w = torch.rand(tokens, k).to(triton_device) if weighted else None
    tol = {"atol": 1e-2, "rtol": 1e-2} if dtype != torch.float32 else {}

    got = ds_kernels.moe_dispatch(x, slot_token, slot_w, backend="triton")
    want = _expected(ds_kernels.moe_dispatch_reference, x, slot_token, slot_w).to(dtype)
    assert got.dtype == dtype and got.shape == (slots, hidden)
    torch.testing.assert_close(got, want, **tol)

    got = ds_kernels.moe_combine(expert_out, token_slot, token_w, backend="triton")
    want = _expected(ds_kernels.moe_combine_reference, expert_out, token_slot, token_w).to(dtype)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    torch.testing.assert_close(got, want, **tol)

    grad = x  # any [tokens, hidden] rows
    got = ds_kernels.moe_combine_weight_grad(grad, expert_out, token_slot, backend="triton")
    want = _expected(ds_kernels.moe_combine_weight_grad_reference, grad, expert_out, token_slot)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, **tol)


def test_triton_handles_rows_longer_than_one_block(triton_device: torch.device) -> None:
    hidden = 2048 + 5  # two column blocks per row
    token_slot, slot_token = _routing(3, 2, 4, device=triton_device)
    x = _rows(3, hidden, torch.float32, triton_device)
    expert_out = _rows(4, hidden, torch.float32, triton_device, seed=4)
    torch.testing.assert_close(
        ds_kernels.moe_dispatch(x, slot_token, backend="triton"),
        ds_kernels.moe_dispatch_reference(x, slot_token),
    )
    torch.testing.assert_close(
        ds_kernels.moe_combine(expert_out, token_slot, backend="triton"),
        ds_kernels.moe_combine_reference(expert_out, token_slot),
    )
    torch.testing.assert_close(
        ds_kernels.moe_combine_weight_grad(x, expert_out, token_slot, backend="triton"),
        ds_kernels.moe_combine_weight_grad_reference(x, expert_out, token_slot),
    )


def test_triton_on_empty_routing(triton_device: torch.device) -> None:
    x = _rows(0, 8, torch.float32, triton_device)
    empty = torch.zeros(0, dtype=torch.int64, device=triton_device)
    assert ds_kernels.moe_dispatch(x, empty, backend="triton").shape == (0, 8)
    out = ds_kernels.moe_combine(x, empty.view(0, 2), backend="triton")
    assert out.shape == (0, 8)


def test_int32_indices_are_accepted() -> None:
    token_slot, slot_token = _routing(5, 2, 8)
    x, expert_out = _rows(5, 4, torch.float32, "cpu"), _rows(8, 4, torch.float32, "cpu")
    torch.testing.assert_close(
        ds_kernels.moe_dispatch(x, slot_token.int()), ds_kernels.moe_dispatch(x, slot_token)
    )
    torch.testing.assert_close(
        ds_kernels.moe_combine(expert_out, token_slot.int()),
        ds_kernels.moe_combine(expert_out, token_slot),
    )


def test_cpu_tensors_use_the_reference_and_keep_autograd() -> None:
    token_slot, slot_token = _routing(5, 1, 8)
    x = _rows(5, 4, torch.float32, "cpu").requires_grad_()
    ds_kernels.moe_dispatch(x, slot_token).sum().backward()
    kept = (token_slot[:, 0] >= 0).float().unsqueeze(1)
    torch.testing.assert_close(x.grad, kept.expand(5, 4))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: ds_kernels.moe_dispatch(torch.ones(3, 2), torch.zeros(4)),
            TypeError,
            "slot_token must be an int32 or int64 tensor",
        ),
        (
            lambda: ds_kernels.moe_dispatch(torch.ones(3), torch.zeros(4, dtype=torch.long)),
            ValueError,
            r"tokens must be 2-D \[rows, hidden\], got shape \(3,\)",
        ),
        (
            lambda: ds_kernels.moe_dispatch(
                torch.ones(3, 2), torch.zeros(4, dtype=torch.long), torch.ones(3)
            ),
            ValueError,
            r"slot_weight must have shape \(4,\)",
        ),
        (
            lambda: ds_kernels.moe_combine(torch.ones(3, 2), torch.zeros(4, dtype=torch.long)),
            ValueError,
            "token_slot must be 2-D",
        ),
        (
            lambda: ds_kernels.moe_combine(
                torch.ones(3, 2), torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1).long()
            ),
            TypeError,
            "token_weight must be a floating tensor",
        ),
        (
            lambda: ds_kernels.moe_combine_weight_grad(
                torch.ones(4, 3), torch.ones(3, 2), torch.zeros(4, 1, dtype=torch.long)
            ),
            ValueError,
            r"grad_out must have shape \(4, 2\)",
        ),
        (
            lambda: ds_kernels.moe_combine_weight_grad(
                torch.ones(4, 2).double(), torch.ones(3, 2), torch.zeros(4, 1, dtype=torch.long)
            ),
            TypeError,
            "must match in dtype and device",
        ),
        (
            lambda: ds_kernels.moe_dispatch(
                torch.ones(3, 2), torch.zeros(4, dtype=torch.long, device="meta")
            ),
            ValueError,
            "slot_token is on meta but the rows are on cpu",
        ),
    ],
)
def test_argument_errors(call, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call()


def test_forced_triton_refuses_unsupported_dtype(triton_device: torch.device) -> None:
    x = torch.ones(3, 2, dtype=torch.float64, device=triton_device)
    index = torch.zeros(4, dtype=torch.long, device=triton_device)
    with pytest.raises(ValueError, match=r"got torch\.float64"):
        ds_kernels.moe_dispatch(x, index, backend="triton")
