"""Partitioned-parameter primitives on 1, 2 and 4 gloo ranks: shards, coalesced gathers,
release, DeepSpeed's attributes, writing shards back, CPU-offloaded shards."""

from __future__ import annotations

import math

import pytest
import torch

from ds_testing import run_on_ranks
from ds_zero import OffloadParamConfig, ParamPartitioner, ZeroParamStatus


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    shapes = [(5, 7), (3,), (11,), (4, 4, 2)]
    return [torch.nn.Parameter(torch.randn(shape)) for shape in shapes]


def _primitives_body(rank: int, world_size: int, *, offload: str) -> None:
    params = _params()
    whole = [p.detach().clone() for p in params]
    if rank:  # ranks disagree before partitioning: the broadcast makes rank 0's values win
        for p in params:
            p.data.add_(rank)
    partitioner = ParamPartitioner(
        persistence_threshold=3, offload=OffloadParamConfig(device=offload)
    )
    partitioner.partition(params, names=[f"p{i}" for i in range(4)], broadcast_from=0)
    partitioner.partition(params)  # idempotent
    assert len(partitioner.params) == 4
    ids = [p.ds_id for p in params]
    assert len(set(ids)) == 4
    for p, w in zip(params, whole):
        s = math.ceil(w.numel() / world_size)
        assert p.ds_shape == tuple(w.shape) and p.ds_numel == w.numel()
        assert p.partition_numel() == s and p.padding_size() == s * world_size - w.numel()
        assert p.ds_tensor.shape == (s,)
        assert p.ds_tensor.device.type == "cpu"
        padded = torch.cat([w.reshape(-1), torch.zeros(s * world_size - w.numel())])
        assert torch.equal(p.ds_tensor, padded[rank * s : (rank + 1) * s])
        assert p.ds_persist == (w.numel() <= 3)
        if p.ds_persist:
            assert p.ds_status is ZeroParamStatus.AVAILABLE and torch.equal(p.data, w)
        else:
            assert p.ds_status is ZeroParamStatus.NOT_AVAILABLE and p.data.numel() == 0
    # one coalesced async gather, waited twice
    handle = partitioner.gather(params, async_op=True)
    assert all(
        p.ds_status is (ZeroParamStatus.AVAILABLE if p.ds_persist else ZeroParamStatus.INFLIGHT)
        for p in params
    )
    again = partitioner.gather(params[:1], async_op=True)  # waits through the first handle
    again.wait()
    handle.wait()
    handle.wait()
    for p, w in zip(params, whole):
        assert p.ds_status is ZeroParamStatus.AVAILABLE
        assert torch.equal(p.data, w) and p.data.is_contiguous()
    assert partitioner.gathered_numel == sum(w.numel() for w in whole if w.numel() > 3)
    partitioner.release(params)
    assert partitioner.gathered_numel == 0
    assert all(p.data.numel() == 0 for p in params if not p.ds_persist)
    # DeepSpeed's bound helpers, and writing a changed whole value back into the shards
    big = params[0]
    big.all_gather()
    with torch.no_grad():
        big.data.mul_(2.0)
    partitioner.write_shard_from_full(big)
    big.partition()
    assert big.data.numel() == 0
    big.all_gather()
    assert torch.equal(big.data, whole[0] * 2)
    big.partition()
    # shard bytes: 1/N of the non-persistent elements (padded) plus whole persistent params
    expected = sum(
        4 * (math.ceil(w.numel() / world_size) + (w.numel() if w.numel() <= 3 else 0))
        for w in whole
    )
    assert partitioner.shard_nbytes() == expected


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_partition_gather_release(world_size: int) -> None:
    run_on_ranks(_primitives_body, world_size, offload="none")


def test_partition_with_cpu_offloaded_shards() -> None:
    run_on_ranks(_primitives_body, 2, offload="cpu")


def test_gather_of_an_unpartitioned_parameter_is_refused() -> None:
    partitioner = ParamPartitioner()
    p = torch.nn.Parameter(torch.ones(4))
    with pytest.raises(ValueError, match="gather it before"):
        partitioner.partition([p])
        p.ds_status = ZeroParamStatus.NOT_AVAILABLE
        partitioner.write_shard_from_full(p)
