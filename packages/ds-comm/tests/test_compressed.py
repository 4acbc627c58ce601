"""Compressed allreduce: exactness against a plain-torch simulation, error bounds, error feedback,
bit packing, and bytes on the wire measured by the comms logger."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ds_comm._bitpack import pack_signs, unpack_signs
from ds_comm._compressed import CompressedAllReduce, compressed_all_reduce
from ds_testing import run_on_ranks


def _sign_compress(c: torch.Tensor) -> torch.Tensor:
    """``scale * sign(c)`` with the norm-preserving scale; zero counts as positive."""
    scale = c.norm() / math.sqrt(c.numel())
    return torch.where(c >= 0, scale, -scale)


class _Reference:
    """Every rank's compressed allreduce simulated in one process: plain torch, no bit packing."""

    def __init__(self, numel: int, world_size: int) -> None:
        chunk = -(-numel // (8 * world_size)) * 8
        self.bounds = [(j * chunk, min((j + 1) * chunk, numel)) for j in range(world_size)]
        self.worker_errors = [torch.zeros(numel) for _ in range(world_size)]
        self.server_errors = [torch.zeros(max(hi - lo, 0)) for lo, hi in self.bounds]

    def step(self, xs: list[torch.Tensor]) -> torch.Tensor:
        out = torch.empty(xs[0].numel())
        for j, (lo, hi) in enumerate(self.bounds):
            if hi <= lo:
                continue
            received = []
            for r, x in enumerate(xs):
                c = x.reshape(-1)[lo:hi].float() + self.worker_errors[r][lo:hi]
                q = _sign_compress(c)
                self.worker_errors[r][lo:hi] = c - q
                received.append(q)
            s = torch.stack(received).mean(0) + self.server_errors[j]
            out[lo:hi] = p = _sign_compress(s)
            self.server_errors[j] = s - p
        return out


def _inputs(
    step: int, world_size: int, shape: tuple[int, ...], dtype: torch.dtype
) -> list[torch.Tensor]:
    return [
        torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step + r)).to(dtype)
        for r in range(world_size)
    ]


def _assert_same_on_all_ranks(t: torch.Tensor, world_size: int) -> None:
    import ds_comm

    gathered = torch.empty(world_size * t.numel(), dtype=t.dtype)
    ds_comm.all_gather_into_tensor(gathered, t.reshape(-1).contiguous())
    for row in gathered.view(world_size, -1):
        assert torch.equal(row, t.reshape(-1))


def _matches_reference_body(
    rank: int, world_size: int, *, shape: tuple[int, ...], dtype: str, steps: int
) -> None:
    dt = getattr(torch, dtype)
    numel = math.prod(shape)
    state = CompressedAllReduce(numel)
    reference = _Reference(numel, world_size)
    tol = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
    for step in range(steps):
        xs = _inputs(step, world_size, shape, dt)
        y = xs[rank].clone()
        assert compressed_all_reduce(y, state) is y
        want = reference.step(xs)
        assert y.dtype == dt and y.shape == shape
        torch.testing.assert_close(y.reshape(-1).float(), want.to(dt).float(), rtol=tol, atol=tol)
        torch.testing.assert_close(state.worker_error[:numel], reference.worker_errors[rank])
        lo, hi = reference.bounds[rank]
        torch.testing.assert_close(
            state.server_error[: max(hi - lo, 0)], reference.server_errors[rank]
        )
        # Padding never accumulates error.
        assert (
            not state.worker_error[numel:].any() and not state.server_error[max(hi - lo, 0) :].any()
        )
        _assert_same_on_all_ranks(y, world_size)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((1,), "float32"),
        ((13,), "float32"),
        ((40, 25), "float32"),
        ((4099,), "float32"),
        ((333,), "float16"),
        ((333,), "bfloat16"),
    ],
)
def test_matches_single_process_simulation(
    world_size: int, shape: tuple[int, ...], dtype: str
) -> None:
    run_on_ranks(_matches_reference_body, world_size, shape=shape, dtype=dtype, steps=3)


def _sign_compression_error(c: torch.Tensor) -> float:
    """||c - Q(c)|| in closed form: expanding the square with scale = ||c||_2 / sqrt(n) gives
    ||c - Q(c)||^2 = 2 ||c||_2 (||c||_2 - ||c||_1 / sqrt(n)): below ||c||^2 when the data is
    dense (||c||_1 > sqrt(n) ||c||_2 / 2; Gaussian data has ||c||_1 ~ 0.8 sqrt(n) ||c||_2)."""
    l2, l1 = c.norm().item(), c.abs().sum().item()
    return math.sqrt(max(0.0, 2 * l2 * (l2 - l1 / math.sqrt(c.numel()))))


def _one_step_error_bound_body(rank: int, world_size: int, *, numel: int) -> None:
    # With zero error buffers, per chunk: out = Q(s), s = mean_r Q(x_r), so
    # out - mean_r x_r = (Q(s) - s) + mean_r (Q(x_r) - x_r) and by the triangle inequality
    # ||out - mean|| <= ||s - Q(s)|| + mean_r ||x_r - Q(x_r)||, each term known in closed form.
    xs = _inputs(7, world_size, (numel,), torch.float32)
    mean = torch.stack(xs).mean(0)
    state = CompressedAllReduce(numel)
    y = compressed_all_reduce(xs[rank].clone(), state)
    chunk = state.chunk_numel
    for lo in range(0, numel, chunk):
        hi = min(lo + chunk, numel)
        worker_errors = [_sign_compression_error(x[lo:hi]) for x in xs]
        s = torch.stack([_sign_compress(x[lo:hi]) for x in xs]).mean(0)
        server_error = _sign_compression_error(s)
        bound = server_error + sum(worker_errors) / world_size
        error = (y[lo:hi] - mean[lo:hi]).norm().item()
        assert 0 < error <= bound * (1 + 1e-4), (error, bound)
        assert bound < 2 * max(x[lo:hi].norm().item() for x in xs)  # not a vacuous bound
        # The state holds exactly the errors of the bound.
        tol = 1e-4 * xs[rank][lo:hi].norm().item()
        assert math.isclose(
            state.worker_error[lo:hi].norm().item(), worker_errors[rank], abs_tol=tol
        )
        if lo // chunk == rank:
            assert math.isclose(
                state.server_error[: hi - lo].norm().item(), server_error, abs_tol=tol
            )


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_one_step_error_within_sign_compression_bound(world_size: int) -> None:
    run_on_ranks(_one_step_error_bound_body, world_size, numel=2001)


def _error_feedback_body(rank: int, world_size: int, *, numel: int, steps: int) -> dict[str, float]:
    import ds_comm

    xs = _inputs(3, world_size, (numel,), torch.float32)
    mean = torch.stack(xs).mean(0)

    def running_mean_errors(
        reset_each_step: bool,
    ) -> tuple[list[float], torch.Tensor, CompressedAllReduce]:
        state = CompressedAllReduce(numel)
        total = torch.zeros(numel, dtype=torch.float64)
        errors = []
        for t in range(1, steps + 1):
            if reset_each_step:
                state.reset()  # no error feedback: every step compresses x afresh
            total += compressed_all_reduce(xs[rank].clone(), state)
            errors.append(((total / t - mean).norm() / mean.norm()).item())
        return errors, total, state

    with_feedback, total, state = running_mean_errors(reset_each_step=False)
    without_feedback, _, _ = running_mean_errors(reset_each_step=True)

    # Telescoping: sum_t out_t = T * mean - mean_r(worker_error_r) - server_error (all chunks).
    worker_error_sum = state.worker_error.clone()
    ds_comm.all_reduce(worker_error_sum)
    server_errors = torch.empty(state.padded_numel)
    ds_comm.all_gather_into_tensor(server_errors, state.server_error)
    predicted = (
        steps * mean.double() - (worker_error_sum / world_size + server_errors)[:numel].double()
    )
    torch.testing.assert_close(total, predicted, rtol=1e-4, atol=1e-3)

    first, last = with_feedback[0], with_feedback[-1]
    assert last < 0.1, with_feedback  # stated tolerance: 10% relative error after 50 steps
    assert last < first / 8, with_feedback
    # Without feedback every step returns the same biased estimate: the error stays put.
    assert without_feedback[-1] > 0.99 * without_feedback[0] > 0.5
    assert math.isclose(without_feedback[0], first, rel_tol=1e-6)
    return {"first": first, "last": last, "no_feedback_last": without_feedback[-1]}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_error_feedback_makes_running_mean_converge(world_size: int) -> None:
    results = run_on_ranks(_error_feedback_body, world_size, numel=4096, steps=50)
    assert all(r == results[0] for r in results)  # identical outputs on every rank


def _wire_bytes_body(rank: int, world_size: int, *, numel: int) -> dict[str, float]:
    import ds_comm

    logger = ds_comm.get_comms_logger()
    saved = logger.config
    ds_comm.configure(enabled=True, prof_all=True)
    try:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
        logger.reset()
        ds_comm.all_reduce(x.clone())
        fp32_bytes = logger.total_wire_bytes()
        state = CompressedAllReduce(numel)
        logger.reset()
        compressed_all_reduce(x, state)
        compressed_bytes = logger.total_wire_bytes()
        ops = sorted(record.op for record in logger.records)
    finally:
        ds_comm.configure(saved)
        logger.reset()
    assert ops == ["all_gather_into_tensor", "all_to_all_single"]
    assert fp32_bytes >= 4 * numel  # 2(n-1)/n * 4 bytes per element
    assert compressed_bytes > 0
    assert fp32_bytes >= 16 * compressed_bytes, (fp32_bytes, compressed_bytes)
    return {"fp32": fp32_bytes, "compressed": compressed_bytes}


def test_wire_bytes_fall_at_least_16x() -> None:
    results = run_on_ranks(_wire_bytes_body, 2, numel=16 * 2**20)  # 64 MiB of fp32
    assert results[0]["fp32"] >= 16 * results[0]["compressed"]


def test_bitpack_matches_numpy_and_round_trips() -> None:
    x = torch.randn(8 * 1001)
    x[::7] = 0.0  # zero packs as non-negative
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 1001
    assert np.array_equal(packed.numpy(), np.packbits((x >= 0).numpy()))
    assert torch.equal(unpack_signs(packed), torch.where(x >= 0, 1.0, -1.0))
    assert unpack_signs(packed, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(torch.randn(12))


def _bad_arguments_body(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match="numel"):
        CompressedAllReduce(0)
    state = CompressedAllReduce(10)
    assert state.padded_numel % (8 * world_size) == 0 and state.padded_numel >= 10
    with pytest.raises(ValueError, match="10 elements"):
        state.compress_all_reduce(torch.randn(11))


def test_bad_arguments() -> None:
    run_on_ranks(_bad_arguments_body, 1)
