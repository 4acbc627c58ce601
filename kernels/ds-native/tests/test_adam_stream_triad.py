"""The bandwidth yardsticks CPU-Adam is benchmarked against: stream_triad, stream_adam_traffic."""

from __future__ import annotations

import pytest
import torch

import ds_native


@pytest.mark.parametrize("n", [0, 1, 15, 17, 1000, 3 * 65536 + 7])
@pytest.mark.parametrize("offset", [0, 1, 5])
@pytest.mark.parametrize("nontemporal", [False, True])
def test_matches_reference(n: int, offset: int, nontemporal: bool) -> None:
    # Offsets leave `a` unaligned: streaming stores start at the first 64-byte boundary.
    gen = torch.Generator().manual_seed(n + offset)
    b, c = (torch.randn(n + offset, generator=gen)[offset:] for _ in range(2))
    a = torch.full((n + offset,), 3.0)[offset:]
    out = ds_native.stream_triad(
        a, b, c, 0.5, nontemporal=nontemporal, num_threads=2, backend="native"
    )
    assert out is a
    torch.testing.assert_close(a, ds_native.stream_triad_reference(torch.empty(n), b, c, 0.5))


def test_in_place_on_b() -> None:
    b, c = torch.randn(1001), torch.randn(1001)
    expected = b + 2.0 * c
    ds_native.stream_triad(b, b, c, 2.0, backend="native")
    torch.testing.assert_close(b, expected)


def test_other_dtypes_run_the_reference() -> None:
    a, b, c = (torch.ones(5, dtype=torch.float64) for _ in range(3))
    ds_native.stream_triad(a, b, c, 2.0)
    torch.testing.assert_close(a, torch.full((5,), 3.0, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"needs torch\.float32 tensors"):
        ds_native.stream_triad(a, b, c, 2.0, backend="native")


def test_partial_overlap_raises_like_torch() -> None:
    buf = torch.arange(10.0)
    with pytest.raises(RuntimeError, match="single memory location"):
        ds_native.stream_triad(buf[1:6], buf[0:5], torch.ones(5), 1.0)


def test_mismatched_inputs_raise() -> None:
    with pytest.raises(ValueError, match=r"c must match a's shape, dtype and device"):
        ds_native.stream_triad(torch.empty(4), torch.ones(4), torch.ones(5), 1.0)


@pytest.mark.parametrize("n", [0, 1, 17, 1000, 3 * 32768 + 5])
def test_adam_traffic_matches_reference(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    ours = [torch.randn(n, generator=gen) for _ in range(4)]
    ref = [t.clone() for t in ours]
    ds_native.stream_adam_traffic(*ours, 0.25, num_threads=2, backend="native")
    ds_native.stream_adam_traffic_reference(*ref, 0.25)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)


def test_adam_traffic_rejects_shared_memory_and_runs_other_dtypes_in_torch() -> None:
    p, g, m = torch.zeros(8), torch.ones(8), torch.zeros(8)
    with pytest.raises(ValueError, match="exp_avg and exp_avg_sq share memory"):
        ds_native.stream_adam_traffic(p, g, m, m, 1.0)
    tensors = [torch.zeros(4, dtype=torch.float64) for _ in range(4)]
    tensors[1] += 2
    ds_native.stream_adam_traffic(*tensors, 0.5)
    assert tensors[0].tolist() == tensors[2].tolist() == tensors[3].tolist() == [1.0] * 4
