"""offload_param nvme: the NVMe shard store round-trips shards through ds-offload-aio files, keeps
at most max_in_cpu elements in host memory, rewrites only changed shards, prefetches; stage 3
training with shards on NVMe equals training with shards in host memory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ds_testing import run_on_ranks
from ds_zero import (
    ConfigError,
    GatheredParameters,
    NvmeShardStore,
    OffloadParamConfig,
    ParamPartitioner,
)

sys.path.insert(0, str(Path(__file__).parent))
from _ds_zero_testing import (
    Recipe,
    adam,
    global_batches,
    make_model,
    micro_batches,
    reference_train,
)


def _nvme(tmp_path: Path, max_in_cpu: int = 0) -> tuple[NvmeShardStore, ParamPartitioner]:
    offload = OffloadParamConfig(
        device="nvme", nvme_path=str(tmp_path), buffer_count=2, buffer_size=1000, max_in_cpu=0
    )
    store = NvmeShardStore.from_config(offload, rank=0)
    store.max_in_cpu = max_in_cpu
    return store, ParamPartitioner(persistence_threshold=0, offload=offload, shard_store=store)


def _params(*sizes: int, dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(n, dtype=dtype)) for n in sizes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shards_round_trip_through_files(tmp_path: Path, dtype: torch.dtype) -> None:
    store, partitioner = _nvme(tmp_path)
    params = _params(1500, 7, 1001, dtype=dtype)  # 1500 fp32 elements span two 4000-byte buffers
    reference = [p.detach().clone() for p in params]
    partitioner.partition(params)
    assert store.folder == tmp_path / "ds_zero_params" / "rank0"
    assert store.writes == 3 and store.resident_numel == 0
    for p, ref in zip(params, reference):
        assert p.ds_tensor.device.type == "meta" and p.ds_tensor.numel() == ref.numel()
        assert Path(store.folder, f"param{p.ds_id}.swp").stat().st_size == ref.nbytes
    partitioner.gather(params).wait()
    for p, ref in zip(params, reference):
        assert torch.equal(p.data, ref)
    assert (store.reads, store.writes, store.resident_numel) == (3, 3, 0)  # nothing rewritten
    partitioner.release(params)
    with GatheredParameters(params[0], modifier_rank=0), torch.no_grad():
        params[0].mul_(2)
    assert store.writes == 4  # the changed shard only
    with GatheredParameters(params):
        assert torch.equal(params[0].data, reference[0] * 2)
        assert torch.equal(params[2].data, reference[2])
    store.close()
    assert not any(store.folder.iterdir())


def test_max_in_cpu_keeps_the_most_recent_shards(tmp_path: Path) -> None:
    store, partitioner = _nvme(tmp_path, max_in_cpu=1600)
    params = _params(600, 600, 600, 600, 600)
    partitioner.partition(params)
    assert [store.is_resident(p) for p in params] == [False, False, False, True, True]
    store.fetch([params[0]])  # read; the least recently used shard not in use makes room
    assert [store.is_resident(p) for p in params] == [True, False, False, False, True]
    assert store.reads == 1 and store.resident_numel == 1200
    store.fetch(params[:3])  # shards in use stay although over the budget
    assert [store.is_resident(p) for p in params] == [True, True, True, False, False]
    assert store.reads == 3 and store.resident_numel == 1800
    store.evict(params[:3])  # unchanged: not rewritten; the least recently used goes
    assert [store.is_resident(p) for p in params] == [False, True, True, False, False]
    assert store.writes == 5 and store.resident_numel == 1200


def test_only_changed_shards_are_written_back(tmp_path: Path) -> None:
    store, partitioner = _nvme(tmp_path)
    params = _params(100, 100, 100)
    partitioner.partition(params)
    store.fetch(params)
    assert store.resident_numel == 300  # in use
    params[1].ds_tensor.add_(1.0)  # in place: the version counter moves
    params[2].ds_tensor = torch.zeros(100)  # replaced: also a change
    store.evict(params)
    assert store.writes == 3 + 2 and store.resident_numel == 0
    store.fetch(params)
    assert torch.equal(params[2].ds_tensor, torch.zeros(100))
    assert torch.equal(params[1].ds_tensor, _params(100, 100)[1].detach() + 1)


def test_prefetch_reads_ahead_once(tmp_path: Path) -> None:
    store, partitioner = _nvme(tmp_path, max_in_cpu=10**6)
    params = _params(300, 200)
    reference = [p.detach().clone() for p in params]
    partitioner.partition(params)
    store.max_in_cpu = 0
    store.evict(params)
    assert store.resident_numel == 0
    store.max_in_cpu = 10**6
    store.prefetch(params)
    store.prefetch(params)  # already in flight: no second read
    store.fetch([params[0]])  # waits for both reads
    assert store.reads == 2 and store.is_resident(params[1])
    partitioner.gather(params).wait()
    assert store.reads == 2
    assert all(torch.equal(p.data, r) for p, r in zip(params, reference))


def test_a_shard_not_in_the_store_is_an_error(tmp_path: Path) -> None:
    store, _ = _nvme(tmp_path)
    p = nn.Parameter(torch.ones(3))
    p.ds_id, p.ds_tensor = 10**9, torch.empty(3, device="meta")
    with pytest.raises(ValueError, match="no shard in host memory"):
        store.fetch([p])


def test_missing_ds_offload_aio_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ds_offload_aio", None)
    with pytest.raises(ConfigError, match=r"pip install ds-zero\[nvme\]"):
        NvmeShardStore(tmp_path)
    with pytest.raises(ConfigError, match="nvme_path"):
        NvmeShardStore.from_config(OffloadParamConfig(device="cpu"), rank=0)


# --- stage 3 training with shards on NVMe ----------------------------------------------------------

STEPS, ROWS = 4, 8


def _train_body(
    rank: int, world_size: int, *, device: str, nvme_path: str
) -> tuple[list[float], float]:
    from ds_zero import Init, Stage3Optimizer, ZeroConfig

    offload = {"device": device}
    if device == "nvme":
        offload.update(nvme_path=nvme_path, max_in_cpu=0)  # every shard goes through its file
    section = {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_param": offload}
    config = ZeroConfig.from_dict(section)
    torch.manual_seed(100 + rank)  # Init and the optimizer take rank 0's initial values
    with Init(config_dict_or_path={"zero_optimization": section}) as init:
        model = make_model(torch.float32, seed=rank)
    zero = Stage3Optimizer(model, adam(list(model.parameters())), config)
    assert zero.partitioner is init.partitioner  # the one holding Init's shards (and store)
    losses = []
    for batch in global_batches(STEPS, ROWS):
        micro = next(micro_batches(batch, rank, world_size, 1))
        loss = model(micro)
        zero.backward(loss)
        zero.step()
        summed = loss.detach().clone()
        torch.distributed.all_reduce(summed)
        losses.append(summed.item() / world_size)
    store = init.partitioner.shard_store
    if device == "nvme":
        assert store.reads > 0 and store.writes > len(list(model.parameters()))
        assert store.resident_numel == 0
    # Single-process training on the whole batches, from rank 0's initial values (seed 0).
    reference = reference_train(
        make_model(torch.float32), global_batches(STEPS, ROWS), Recipe(adam)
    )
    with GatheredParameters(model.parameters()):
        error = max(
            ((p - reference[n]).abs().max() / reference[n].abs().max()).item()
            for n, p in model.named_parameters()
        )
    return losses, error


@pytest.mark.parametrize("world_size", [2])
def test_stage3_training_with_nvme_shards_equals_cpu_shards(
    world_size: int, tmp_path: Path
) -> None:
    cpu, cpu_error = run_on_ranks(_train_body, world_size, device="cpu", nvme_path="")[0]
    nvme, nvme_error = run_on_ranks(
        _train_body, world_size, device="nvme", nvme_path=str(tmp_path)
    )[0]
    assert nvme == cpu, (nvme, cpu)
    assert cpu[-1] < cpu[0]
    assert cpu_error <= 1e-5 and nvme_error <= 1e-5, (cpu_error, nvme_error)
