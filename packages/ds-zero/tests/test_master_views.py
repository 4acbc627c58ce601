"""``ZeroOptimizer.master_views`` and ``refresh_fp32_params(exclude=...)``: where a weights-only
load writes loaded weights straight into the fp32 masters (ds-engine's [Note: weights loaded
into the masters]), on 1, 2 and 4 ranks of real gloo processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _ds_zero_testing import adam, global_batches, make_model, micro_batches


def _views_body(rank: int, world_size: int, *, dtype_name: str) -> dict[str, object]:
    import torch

    from ds_zero import ZeroConfig, ZeroOptimizer

    dtype = getattr(torch, dtype_name)
    model = make_model(dtype)
    config = ZeroConfig.from_dict({"stage": 2, "reduce_bucket_size": 700})
    zero = ZeroOptimizer(model, adam(list(model.parameters())), config)
    for micro in micro_batches(global_batches(1, 8)[0], rank, world_size, 1):
        zero.backward(model(micro))
        zero.step()
    params = dict(model.named_parameters())
    views = zero.master_views()
    for name, view in views.items():  # the master holds what the parameter holds
        param = params[name].detach()
        assert view.shape == param.shape and view.dtype == torch.float32
        assert torch.equal(view.to(param.dtype), param), name
    masters_before = [m.clone() for m in zero.masters]
    loaded = {name: torch.full_like(view, 7.0) for name, view in views.items()}
    for name, view in views.items():  # a load writes them
        view.copy_(loaded[name])
    zero.refresh_fp32_params(exclude=views)  # the others from the parameters
    for name, view in views.items():
        assert torch.equal(view, loaded[name]), f"{name} was refreshed over"
    untouched = [m.clone() for m in zero.masters]
    zero.refresh_fp32_params()  # a failed load puts every master back (exact from fp32)
    for before, after in zip(masters_before, zero.masters):
        assert torch.equal(before, after) or dtype != torch.float32
    # what the exclusion left alone is exactly the views' elements
    changed = sum(int((a != b).sum()) for a, b in zip(untouched, masters_before))
    return {
        "names": sorted(views),
        "elements": sum(v.numel() for v in views.values()),
        "changed": changed,
        "partition": sum(m.numel() for m in zero.masters),
        "trainable": sorted(n for n, p in params.items() if p.requires_grad),
        "sizes": {n: p.numel() for n, p in params.items()},
        "boundaries": sum(len(g.units) for g in zero.groups) * (world_size - 1),
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_master_views_hold_whole_parameters_and_refresh_skips_them(world_size: int) -> None:
    results = run_on_ranks(_views_body, world_size, dtype_name="float32", timeout=120)
    named = [name for r in results for name in r["names"]]
    assert len(named) == len(set(named)), "a parameter viewed whole on two ranks"
    for r in results:  # every element a view holds is one refresh_fp32_params() left out
        assert r["changed"] == r["elements"]
    if world_size == 1:  # one rank holds every parameter whole
        assert named and sorted(named) == results[0]["trainable"]
    else:  # the parameters no rank holds whole straddle a partition boundary
        straddling = set(results[0]["trainable"]) - set(named)
        assert 0 < len(straddling) <= results[0]["boundaries"]
        assert named, "no parameter whole on any rank"


def test_no_master_views_in_bf16() -> None:
    # a failed load restores the masters from the parameters: exact only from fp32 ones
    (result,) = run_on_ranks(_views_body, 1, dtype_name="bfloat16", timeout=120)
    assert result["trainable"] and result["names"] == []


def _flat_master_body(rank: int, world_size: int) -> int:
    import torch

    from ds_zero import ZeroConfig, ZeroOptimizer

    model = make_model(torch.float32)
    zero = ZeroOptimizer(model, adam(list(model.parameters())), ZeroConfig.from_dict({}))
    return len(zero.master_views())


def test_no_master_views_where_the_masters_are_the_parameters() -> None:
    # stage 0 in fp32: the optimizer steps the parameters' own flat buffer
    assert run_on_ranks(_flat_master_body, 1) == [0]
