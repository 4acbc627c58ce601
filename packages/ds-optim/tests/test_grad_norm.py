"""Global gradient norm and clipping: parity with torch on a whole model, sharded gradients on
real gloo ranks (the norm of the whole), inf/nan, and fp16/bf16 gradients."""

from __future__ import annotations

import math

import pytest
import torch

from ds_optim import clip_grad_norm_, global_grad_norm
from ds_testing import run_on_ranks

NORM_TYPES = [2.0, 1.0, 3.0, math.inf]


def _model_with_grads(seed: int, scale: float = 1.0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(7, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    (model(torch.randn(5, 7)).square().sum() * scale).backward()
    return model


def _full_grads(seed: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def _torch_clip(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ on ``grads`` in place (it reads ``.grad`` of parameters)."""
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.empty_like(g))
        p.grad = g
        params.append(p)
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


# --- one process: parity with torch ------------------------------------------------------------


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_norm_and_clipping_match_torch_on_a_whole_model(norm_type: float) -> None:
    ours, theirs = _model_with_grads(0), _model_with_grads(0)
    max_norm = 0.1  # well below the norm, so clipping happens
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm, norm_type)
    got = clip_grad_norm_(ours.parameters(), max_norm, norm_type)
    assert got.dtype == torch.float32 and got.dim() == 0
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert float(got) > max_norm
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
    clipped = global_grad_norm(ours.parameters(), norm_type)
    assert float(clipped) == pytest.approx(max_norm, rel=1e-5)


def test_gradients_under_the_limit_are_left_exactly_as_they_are() -> None:
    model = _model_with_grads(1)
    before = [p.grad.clone() for p in model.parameters()]
    norm = clip_grad_norm_(model.parameters(), max_norm=1e6)
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    assert float(norm) == pytest.approx(
        float(torch.linalg.vector_norm(torch.cat([b.flatten() for b in before])))
    )


def test_params_without_grads_are_skipped_and_no_grads_give_zero() -> None:
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    assert float(global_grad_norm([a, b])) == 0.0
    a.grad = torch.full((3,), 2.0)
    assert float(global_grad_norm([a, b])) == pytest.approx(math.sqrt(12.0))  # sqrt(3 * 2^2)
    assert float(global_grad_norm(a.grad)) == pytest.approx(math.sqrt(12.0))  # one tensor


def test_bad_arguments() -> None:
    g = [torch.ones(2)]
    for bad in (0, -2.0, math.nan):
        with pytest.raises(ValueError, match="norm_type"):
            global_grad_norm(g, bad)
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_(g, max_norm=0.0)
    assert float(global_grad_norm(g, "inf")) == 1.0  # torch's spelling works


# --- inf and nan -------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([math.inf], math.inf),
        ([-math.inf], math.inf),
        ([math.nan], math.nan),
        ([math.inf, math.nan], math.nan),
    ],
)
def test_non_finite_grads_give_a_non_finite_norm_and_are_not_clipped(
    norm_type: float, values: list[float], expected: float
) -> None:
    grads = [torch.ones(4), torch.ones(5)]
    for i, v in enumerate(values):
        grads[1][i] = v
    before = [g.clone() for g in grads]
    norm = clip_grad_norm_(grads, max_norm=0.5, norm_type=norm_type)
    if math.isnan(expected):
        assert math.isnan(float(norm))
    else:
        assert float(norm) == expected
    for g, b in zip(grads, before):
        torch.testing.assert_close(g, b, equal_nan=True, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="error_if_nonfinite"):
        clip_grad_norm_(grads, max_norm=0.5, norm_type=norm_type, error_if_nonfinite=True)


# --- fp16 and bf16 -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_norms_accumulate_in_fp32(dtype: torch.dtype) -> None:
    # 100000 entries of 256 (exact in both dtypes): the sum of squares, 6.5536e9, overflows fp16
    # and loses bits in bf16, while the norm 256 * sqrt(1e5) = 80953.07... is representable.
    g = torch.full((100_000,), 256.0, dtype=dtype)
    assert float(global_grad_norm([g])) == pytest.approx(256.0 * math.sqrt(1e5), rel=1e-6)
    assert float(global_grad_norm([g], 1.0)) == pytest.approx(256.0 * 1e5, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_clipping_low_precision_grads_matches_fp32_clipping(dtype: torch.dtype) -> None:
    full = [_full_grads(3, 1000) * 50, _full_grads(4, 10)]
    low = [g.to(dtype) for g in full]
    reference = [g.float() for g in low]  # the same values, in fp32
    want = _torch_clip(reference, 1.0)
    got = clip_grad_norm_(low, 1.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
    for g, r in zip(low, reference):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), r, rtol=1e-2, atol=1e-4)


# --- sharded gradients on real ranks ------------------------------------------------------------


def _sharded_norm_body(rank: int, world_size: int, *, numel: int) -> list[float]:
    import torch.distributed as dist

    full = _full_grads(7, numel)
    # Uneven shards, and each rank's shard in two tensors of different dtypes.
    mine = torch.tensor_split(full, world_size)[rank]
    half = mine.numel() // 2
    shard = [mine[:half].clone(), mine[half:].double()]
    norms = []
    for p in NORM_TYPES:
        got = global_grad_norm(shard, p, group=dist.group.WORLD)
        want = torch.linalg.vector_norm(full, p)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        norms.append(float(got))

    reference = full.clone()
    want = _torch_clip([reference], 0.5)
    got = clip_grad_norm_(shard, 0.5, group=dist.group.WORLD)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    clipped = torch.cat([shard[0], shard[1].float()])
    torch.testing.assert_close(
        clipped, torch.tensor_split(reference, world_size)[rank], rtol=1e-6, atol=1e-9
    )
    return norms


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_sharded_norm_equals_the_norm_of_the_whole(world_size: int) -> None:
    results = run_on_ranks(_sharded_norm_body, world_size, numel=1001, timeout=300)
    assert all(r == results[0] for r in results)  # bit-identical on every rank


def _one_rank_non_finite_body(rank: int, world_size: int, *, bad: float) -> list[float]:
    import torch.distributed as dist

    shard = [torch.ones(10)]
    if rank == world_size - 1:
        shard[0][3] = bad
    out = []
    for p in NORM_TYPES:
        before = shard[0].clone()
        out.append(float(clip_grad_norm_(shard, 0.5, p, group=dist.group.WORLD)))
        torch.testing.assert_close(shard[0], before, equal_nan=True, rtol=0, atol=0)
    return out


@pytest.mark.parametrize("bad", [math.inf, math.nan])
@pytest.mark.parametrize("world_size", [2, 4])
def test_one_ranks_non_finite_shard_makes_every_ranks_norm_non_finite(
    world_size: int, bad: float
) -> None:
    results = run_on_ranks(_one_rank_non_finite_body, world_size, bad=bad, timeout=300)
    for norms in results:
        if math.isnan(bad):  # including the inf-norm, whose MAX reduce would drop a nan
            assert all(math.isnan(n) for n in norms)
        else:
            assert norms == [math.inf] * len(NORM_TYPES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_a_large_cpu_gradient_is_normed_by_rows_as_precisely_as_in_fp64(
    dtype: torch.dtype, norm_type: float
) -> None:
    """Above 4M elements a CPU norm is reduced by rows (see [Note: large CPU norms]): within 1e-5
    of the fp64 norm (torch's one-vector bf16 reduction was 3% off on 200M), and non-finite
    values still decide it."""
    grad = torch.randn((1 << 22) + 3, generator=torch.Generator().manual_seed(0)).to(dtype)
    exact = torch.linalg.vector_norm(grad.double(), norm_type)
    norm = global_grad_norm([grad, torch.ones(5)], norm_type)
    small = torch.linalg.vector_norm(torch.ones(5, dtype=torch.float64), norm_type)
    expected = torch.linalg.vector_norm(torch.stack([exact, small]), norm_type)
    assert norm.dtype == torch.float32
    assert abs(norm.double() - expected) <= 1e-5 * expected
    grad[12345] = math.inf
    assert global_grad_norm([grad], norm_type) == math.inf
    grad[54321] = math.nan
    assert math.isnan(global_grad_norm([grad], norm_type))
