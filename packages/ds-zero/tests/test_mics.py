"""MiCS at stage 3 (``mics_shard_size``) on 2 and 4 gloo ranks: parameters, gradients and
optimizer state sharded within groups of ``m`` ranks and replicated across them train as plain
ZeRO-3 does (the same mean gradient over all ranks: within fp32 rounding, since the sum is taken
in two hops), the gathers stay within the shard groups and the replicas stay identical.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _ds_zero_testing import adam, global_batches, make_model, micro_batches

STEPS = 4
ROWS = 16
TOLERANCE = 1e-5  # fp32: relative L2 distance of the whole model's weights


def _section(**extra: Any) -> dict[str, Any]:
    return {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_reuse_distance": 0,
        "reduce_bucket_size": 4000,
        **extra,
    }


def _train(rank: int, world_size: int, section: dict[str, Any], accum: int) -> dict[str, Any]:
    import ds_comm
    from ds_zero import Stage3Optimizer, ZeroConfig

    torch.manual_seed(rank)  # different initial weights per rank: MiCS must broadcast them
    model = make_model(torch.float32, seed=0 if rank == 0 else 100 + rank)
    zero = Stage3Optimizer(
        model,
        adam(list(model.parameters())),
        ZeroConfig.from_dict(section),
        gradient_accumulation_steps=accum,
    )
    logger = ds_comm.get_comms_logger()
    previous = ds_comm.configure(enabled=True, prof_all=True)
    logger.reset()
    losses = []
    try:
        for batch in global_batches(STEPS, ROWS):
            for micro in micro_batches(batch, rank, world_size, accum):
                loss = model(micro)
                zero.backward(loss)
            assert not zero.step().skipped
            losses.append(loss.item())
        gathers = {r.group_size for r in logger.summary() if "all_gather" in r.op}
    finally:
        ds_comm.configure(previous)
        logger.reset()
    params = list(model.parameters())
    zero.partitioner.gather(params).wait()
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    zero.partitioner.release(params)
    shard = zero.memory_breakdown().params
    zero.destroy()
    return {"state": state, "gathers": gathers, "shard": shard}


def _distance(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    diff = sum(((state[n] - ref) ** 2).sum() for n, ref in reference.items())
    return float((diff / sum((ref**2).sum() for ref in reference.values())).sqrt())


def _mics_body(rank: int, world_size: int, *, shard_size: int, accum: int) -> dict[str, Any]:
    import torch.distributed as dist

    plain = _train(rank, world_size, _section(), accum)
    mics = _train(rank, world_size, _section(mics_shard_size=shard_size), accum)
    error = _distance(mics["state"], plain["state"])
    assert error <= TOLERANCE, error
    assert mics["gathers"] <= {shard_size}, mics["gathers"]  # within the shard group only
    # each rank holds 1/shard_size of the model (ZeRO-3: 1/world_size)
    assert mics["shard"] * shard_size == pytest.approx(plain["shard"] * world_size, rel=0.05)
    # the replicas are identical: every rank's whole model equals rank 0's
    flat = torch.cat([v.reshape(-1) for v in mics["state"].values()])
    first = flat.clone()
    dist.broadcast(first, 0)
    assert torch.equal(flat, first)
    return {"error": error}


@pytest.mark.parametrize("world_size, shard_size", [(2, 2), (4, 2)])
def test_mics_matches_zero3(world_size: int, shard_size: int) -> None:
    run_on_ranks(_mics_body, world_size, shard_size=shard_size, accum=1, timeout=600)


@pytest.mark.slow
def test_mics_matches_zero3_with_accumulation() -> None:
    run_on_ranks(_mics_body, 4, shard_size=2, accum=2, timeout=600)


def _whole(zero: Any, model: torch.nn.Module) -> torch.Tensor:
    params = list(model.parameters())
    zero.partitioner.gather(params).wait()
    flat = torch.cat([p.detach().reshape(-1).clone() for p in params])
    zero.partitioner.release(params)
    return flat


def _checkpoint_body(rank: int, world_size: int, *, path: str) -> None:
    """A MiCS checkpoint is an ordinary sharded one: it loads into plain ZeRO-3 and into MiCS
    with the saved weights and optimizer state (the next step agrees too)."""
    from ds_zero import (
        Stage3Optimizer,
        ZeroConfig,
        load_sharded_checkpoint,
        save_sharded_checkpoint,
    )

    batches = global_batches(3, ROWS)
    micro = [next(micro_batches(b, rank, world_size, 1)) for b in batches]
    model = make_model(torch.float32)
    config = ZeroConfig.from_dict(_section(mics_shard_size=2))
    zero = Stage3Optimizer(model, adam(list(model.parameters())), config)
    for batch in micro[:2]:
        zero.backward(model(batch))
        zero.step()
    save_sharded_checkpoint(path, zero)
    saved = _whole(zero, model)
    zero.destroy()
    results = []
    for target in (_section(), _section(mics_shard_size=2)):
        model = make_model(torch.float32, seed=7)
        config = ZeroConfig.from_dict(target)
        zero = Stage3Optimizer(model, adam(list(model.parameters())), config)
        load_sharded_checkpoint(path, zero)
        assert torch.equal(_whole(zero, model), saved)
        zero.backward(model(micro[2]))
        zero.step()
        results.append(_whole(zero, model))
        zero.destroy()
    # the step after loading: plain ZeRO-3 and MiCS agree (fp32 rounding of the two-hop sum)
    assert _distance_flat(results[0], results[1]) <= TOLERANCE


def _distance_flat(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_mics_checkpoint_loads_into_zero3_and_mics(tmp_path: Path) -> None:
    run_on_ranks(_checkpoint_body, 4, path=str(tmp_path / "ckpt"), timeout=300)


def _bad_size_body(rank: int, world_size: int) -> None:
    from ds_zero import Stage3Optimizer, ZeroConfig

    model = make_model(torch.float32)
    for size, words in ((3, "size 4"), (1, "use ZeRO stage 1 or 2")):
        config = ZeroConfig.from_dict(_section(mics_shard_size=size))
        with pytest.raises(
            ValueError, match=f"mics_shard_size = {size} must be a divisor.*{words}"
        ):
            Stage3Optimizer(model, adam(list(model.parameters())), config)


def test_mics_shard_size_must_divide_the_data_parallel_size() -> None:
    run_on_ranks(_bad_size_body, 4, timeout=120)


def test_mics_config_is_checked() -> None:
    from ds_zero import ConfigError, ZeroConfig

    with pytest.raises(ConfigError, match="mics_shard_size = 2 is a feature of stage 3"):
        ZeroConfig.from_dict({"stage": 2, "mics_shard_size": 2})
    with pytest.raises(ConfigError, match="set only one of them"):
        ZeroConfig.from_dict({"stage": 3, "mics_shard_size": 2, "zero_hpz_partition_size": 2})
    with pytest.raises(ConfigError, match="mics_shard_size = 0: expected -1"):
        ZeroConfig.from_dict({"stage": 3, "mics_shard_size": 0})
    assert ZeroConfig.from_dict({"stage": 3, "mics_shard_size": 4}).mics_shard_size == 4
