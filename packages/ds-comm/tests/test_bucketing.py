"""Bucketing: grouping, dtype/device splitting, alignment, zero-copy views, and bucketed all_reduce."""

from __future__ import annotations

import random

import pytest
import torch

from ds_comm._bucketing import Bucket, flatten_into_buckets, unflatten_bucket
from ds_testing import run_on_ranks


def _nbytes(t: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    return t.numel() * (dtype or t.dtype).itemsize


def _ids(tensors: list[torch.Tensor]) -> list[int]:
    return [id(t) for t in tensors]


def test_groups_consecutive_tensors_up_to_bucket_size() -> None:
    tensors = [torch.randn(10) for _ in range(5)]  # 40 bytes each
    buckets = flatten_into_buckets(tensors, 100)
    assert [len(b.tensors) for b in buckets] == [2, 2, 1]
    assert [b.offsets for b in buckets] == [[0, 10], [0, 10], [0]]
    assert _ids([t for b in buckets for t in b.tensors]) == _ids(tensors)


@pytest.mark.parametrize("seed", range(5))
def test_random_sizes_fill_greedily_without_exceeding(seed: int) -> None:
    rng = random.Random(seed)
    tensors = [torch.randn(rng.randint(0, 60)) for _ in range(40)]
    limit = 128
    buckets = flatten_into_buckets(tensors, limit)
    assert _ids([t for b in buckets for t in b.tensors]) == _ids(tensors)  # order kept, none lost
    sizes = [sum(_nbytes(t) for t in b.tensors) for b in buckets]
    for bucket, size in zip(buckets, sizes):
        assert size <= limit or len(bucket.tensors) == 1
    # Greedy: a bucket was closed only because the next tensor did not fit.
    for size, nxt in zip(sizes, buckets[1:]):
        assert size + _nbytes(nxt.tensors[0]) > limit


def test_oversized_tensor_gets_its_own_bucket() -> None:
    small, big, tail = torch.randn(4), torch.randn(100), torch.randn(4)
    buckets = flatten_into_buckets([small, big, tail], 64)
    assert [_ids(b.tensors) for b in buckets] == [_ids([small]), _ids([big]), _ids([tail])]
    assert buckets[1].buffer.numel() == 100


def test_dtypes_and_devices_split_without_fragmenting() -> None:
    a32, b16, c32, d16 = (
        torch.randn(3),
        torch.randn(3).half(),
        torch.randn(5),
        torch.randn(2).half(),
    )
    meta = torch.empty(7, device="meta")
    buckets = flatten_into_buckets([a32, b16, meta, c32, d16], 1 << 20)
    assert [b.buffer.dtype for b in buckets] == [torch.float32, torch.float16, torch.float32]
    assert [b.buffer.device.type for b in buckets] == ["cpu", "cpu", "meta"]
    assert _ids(buckets[0].tensors) == _ids([a32, c32]) and buckets[0].offsets == [0, 3]
    assert _ids(buckets[1].tensors) == _ids([b16, d16]) and buckets[1].offsets == [0, 3]
    assert _ids(buckets[2].tensors) == _ids([meta])


def test_buffer_holds_member_values_and_views_share_its_storage() -> None:
    tensors = [torch.randn(2, 3), torch.randn(4), torch.randn(1, 1, 5)]
    (bucket,) = flatten_into_buckets(tensors, 1 << 20)
    torch.testing.assert_close(
        bucket.buffer, torch.cat([t.reshape(-1) for t in tensors]), rtol=0, atol=0
    )
    views = unflatten_bucket(bucket)
    base = bucket.buffer.data_ptr()
    for view, t, off in zip(views, tensors, bucket.offsets):
        assert view.shape == t.shape
        assert view.data_ptr() == base + off * view.element_size()  # a view, not a copy
        assert view.untyped_storage().data_ptr() == bucket.buffer.untyped_storage().data_ptr()
        torch.testing.assert_close(view, t, rtol=0, atol=0)
    bucket.buffer.fill_(3.0)
    assert all(bool((v == 3.0).all()) for v in views)
    assert not any(bool((t == 3.0).all()) for t in tensors)  # originals are separate copies


def test_copy_back_writes_buffer_into_originals() -> None:
    a = torch.randn(3, 4)
    b = torch.randn(5, 2).t()  # non-contiguous member
    (bucket,) = flatten_into_buckets([a, b], 1 << 20)
    expected = [a * 2 + 1, b * 2 + 1]
    bucket.buffer.mul_(2).add_(1)
    a_ptr, b_ptr = a.data_ptr(), b.data_ptr()
    bucket.copy_back()
    torch.testing.assert_close(a, expected[0])
    torch.testing.assert_close(b, expected[1])
    assert (a.data_ptr(), b.data_ptr()) == (a_ptr, b_ptr)  # written in place


def test_dtype_override_casts_in_and_back() -> None:
    grads = [torch.randn(4, dtype=torch.bfloat16), torch.randn(3, dtype=torch.float16)]
    (bucket,) = flatten_into_buckets(grads, 1 << 20, dtype=torch.float32)
    assert bucket.buffer.dtype == torch.float32
    torch.testing.assert_close(bucket.buffer, torch.cat([g.float() for g in grads]), rtol=0, atol=0)
    bucket.buffer.mul_(0.5)
    expected = [(g.float() * 0.5).to(g.dtype) for g in grads]
    bucket.copy_back()
    for g, e in zip(grads, expected):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    with pytest.raises(TypeError, match="alias"):
        bucket.alias_members()


@pytest.mark.parametrize("align", [1, 4, 8, 24])
def test_alignment_pads_buffers_with_zeros(align: int) -> None:
    tensors = [torch.randn(n) + 10 for n in (3, 7, 11, 2, 30)]
    buckets = flatten_into_buckets(tensors, 64, align_elements=align)
    for bucket in buckets:
        used = sum(t.numel() for t in bucket.tensors)
        assert bucket.used_numel == used
        assert bucket.buffer.numel() % align == 0
        assert used <= bucket.buffer.numel() < used + align
        assert bool((bucket.buffer[used:] == 0).all())
        for view, t in zip(unflatten_bucket(bucket), bucket.tensors):
            torch.testing.assert_close(view, t, rtol=0, atol=0)


def test_alias_members_repoints_parameters_without_copies() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    params = list(model.parameters())
    before = [p.detach().clone() for p in params]
    (bucket,) = flatten_into_buckets(params, 1 << 20)
    bucket.alias_members()
    assert list(model.parameters()) == params  # same Parameter objects, still registered
    base, end = bucket.buffer.data_ptr(), bucket.buffer.data_ptr() + bucket.buffer.nbytes
    for p, b, off in zip(params, before, bucket.offsets):
        assert p.data_ptr() == base + off * p.element_size()
        assert base <= p.data_ptr() < end
        torch.testing.assert_close(p.detach(), b, rtol=0, atol=0)
    # An optimizer step on the parameters lands in the buffer: no flatten copy next time.
    model(torch.randn(5, 4)).sum().backward()
    torch.optim.SGD(params, lr=0.1).step()
    torch.testing.assert_close(bucket.buffer, torch.cat([p.detach().reshape(-1) for p in params]))
    assert not torch.equal(bucket.buffer, torch.cat([b.reshape(-1) for b in before]))
    ptrs = [p.data_ptr() for p in params]
    bucket.copy_back()  # aliased members: nothing to copy
    assert [p.data_ptr() for p in params] == ptrs


def test_empty_input_and_bad_arguments() -> None:
    assert flatten_into_buckets([], 64) == []
    with pytest.raises(ValueError, match="bucket_size_bytes"):
        flatten_into_buckets([torch.randn(2)], 0)
    with pytest.raises(ValueError, match="align_elements"):
        flatten_into_buckets([torch.randn(2)], 64, align_elements=0)
    assert Bucket(torch.empty(0), [], []).used_numel == 0


def _grads(model: torch.nn.Module, rank: int) -> list[torch.Tensor]:
    model.zero_grad()
    gen = torch.Generator().manual_seed(100 + rank)
    model(torch.randn(6, 8, generator=gen)).pow(2).sum().backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _bucketed_grads_body(rank: int, world_size: int) -> None:
    import ds_comm

    torch.manual_seed(0)  # same model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    # Single-process reference: every rank's gradients, computed here and summed.
    reference = [sum(gs) for gs in zip(*(_grads(model, r) for r in range(world_size)))]

    per_tensor = _grads(model, rank)
    for g in per_tensor:
        ds_comm.all_reduce(g)

    bucketed = _grads(model, rank)
    buckets = flatten_into_buckets(bucketed, 300)  # [w1], [b1, w2, b2]
    assert [len(b.tensors) for b in buckets] == [1, 3]
    for bucket in buckets:
        ds_comm.all_reduce(bucket.buffer)
        bucket.copy_back()
    for got, want, ref in zip(bucketed, per_tensor, reference):
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got, ref)

    # Aligned buckets reduce-scatter evenly: each rank's shard is its slice of the summed bucket.
    sharded = _grads(model, rank)
    got_buckets = flatten_into_buckets(sharded, 300, align_elements=world_size)
    ref_buckets = flatten_into_buckets(reference, 300, align_elements=world_size)
    for bucket, ref in zip(got_buckets, ref_buckets, strict=True):
        shard = torch.empty(bucket.buffer.numel() // world_size)
        ds_comm.reduce_scatter_tensor(shard, bucket.buffer)
        torch.testing.assert_close(shard, ref.buffer.view(world_size, -1)[rank])


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_bucketed_all_reduce_matches_per_tensor(world_size: int) -> None:
    run_on_ranks(_bucketed_grads_body, world_size)
