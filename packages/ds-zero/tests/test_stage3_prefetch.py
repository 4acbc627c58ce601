"""Stage 3 trace and prefetch on 1, 2 and 4 gloo ranks: prefetch hits after the first step,
``stage3_max_live_parameters`` bounds the gathered working set, ``stage3_max_reuse_distance``
keeps parameters between forward and backward, and a data-dependent branch invalidates the trace
while training still equals single-process training."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _ds_zero_testing import (
    TinyGPT,
    _Block,
    adam,
    global_batches,
    micro_batches,
)

STEPS = 12
ROWS = 16


class BranchyGPT(TinyGPT):
    """TinyGPT with an extra block used only when ``use_extra`` is set (a data-dependent branch
    in real models: early exit, mixture routing, ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = _Block(32, 2)
        self.use_extra = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = self.tok(inputs) + self.pos(torch.arange(inputs.shape[1]))
        for block in self.blocks:
            x = block(x)
        if self.use_extra:
            x = self.extra(x)
        logits = self.head(self.norm(x)).float()
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )


def _make(seed: int = 0) -> BranchyGPT:
    torch.manual_seed(seed)
    return BranchyGPT()


def _branch_taken(step: int, branchy: bool) -> bool:
    return branchy and step % 2 == 1


def _reference(branchy: bool) -> dict[str, torch.Tensor]:
    """Single-process training on the full batch; unused parameters step with zero gradients,
    as ZeRO's (their shard's gradient is zero)."""
    model = _make()
    optimizer = adam(list(model.parameters()))
    for step, batch in enumerate(global_batches(STEPS, ROWS)):
        model.use_extra = _branch_taken(step, branchy)
        model(batch).backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_body(
    rank: int, world_size: int, *, branchy: bool, section: dict, check_live: bool = False
) -> dict:
    from ds_zero import Stage3Optimizer, ZeroConfig

    model = _make()
    config = ZeroConfig.from_dict({"stage": 3, "stage3_param_persistence_threshold": 64, **section})
    zero = Stage3Optimizer(model, adam(list(model.parameters())), config)
    partitioner = zero.partitioner
    largest_module = max(
        sum(p.ds_numel for p in zero.hooks.fetch_set(m) if not p.ds_persist)
        for m in model.modules()
    )
    stats_after_first = None
    kept_between = 0
    for step, batch in enumerate(global_batches(STEPS, ROWS)):
        model.use_extra = _branch_taken(step, branchy)
        micro = next(micro_batches(batch, rank, world_size, 1))
        partitioner.peak_gathered_numel = partitioner.gathered_numel
        loss = model(micro)
        kept_between = max(kept_between, partitioner.gathered_numel)
        zero.backward(loss)
        zero.step()
        if check_live and step > 0:
            limit = config.stage3_max_live_parameters
            # prefetch never goes past the limit; a module's own fetch set may
            assert partitioner.peak_gathered_numel <= limit + largest_module
        if step == 0:
            stats_after_first = (zero.prefetch_stats.hits, zero.prefetch_stats.misses)
    model.use_extra = False
    params = list(model.parameters())
    partitioner.gather(params).wait()
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    partitioner.release(params)
    reference = _reference(branchy)
    error = max(
        (state[n] - r).abs().max().item() / max(r.abs().max().item(), 1e-12)
        for n, r in reference.items()
    )
    stats = zero.prefetch_stats
    return {
        "error": error if math.isfinite(error) else math.inf,
        "first": stats_after_first,
        "hits": stats.hits,
        "misses": stats.misses,
        "invalidations": stats.invalidations,
        "prefetched": stats.prefetched,
        "kept_between": kept_between,
    }


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_prefetch_hits_after_the_first_step(world_size: int) -> None:
    section = {"stage3_prefetch_bucket_size": 10**6, "stage3_max_reuse_distance": 0}
    for r in run_on_ranks(_train_body, world_size, branchy=False, section=section, timeout=300):
        assert r["error"] <= 1e-5
        assert r["first"] == (0, 0)  # the first step records the trace
        assert r["invalidations"] == 0
        assert r["hits"] > 0 and r["prefetched"] > 0
        assert r["misses"] == 0  # every fetch after the first step was prefetched


def test_max_live_parameters_bounds_the_prefetch() -> None:
    section = {
        "stage3_prefetch_bucket_size": 10**6,
        "stage3_max_live_parameters": 5000,
        "stage3_max_reuse_distance": 0,
    }
    results = run_on_ranks(
        _train_body, 2, branchy=False, section=section, check_live=True, timeout=300
    )
    for r in results:
        assert r["error"] <= 1e-5 and r["hits"] > 0 and r["misses"] > STEPS


def test_without_prefetch_nothing_is_prefetched() -> None:
    section = {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}
    for r in run_on_ranks(_train_body, 2, branchy=False, section=section, timeout=300):
        assert r["error"] <= 1e-5 and r["hits"] == 0 and r["prefetched"] == 0
        assert r["kept_between"] == 0  # every parameter released after its module's forward


def test_reuse_distance_keeps_parameters_for_backward() -> None:
    # DeepSpeed's default distance (1e9 elements) keeps what backward uses again soon.
    section = {"stage3_prefetch_bucket_size": 0}
    for r in run_on_ranks(_train_body, 2, branchy=False, section=section, timeout=300):
        assert r["error"] <= 1e-5 and r["kept_between"] > 0


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_a_data_dependent_branch_invalidates_the_trace(world_size: int) -> None:
    section = {"stage3_prefetch_bucket_size": 10**6, "stage3_max_reuse_distance": 0}
    for r in run_on_ranks(_train_body, world_size, branchy=True, section=section, timeout=300):
        assert r["error"] <= 1e-5
        assert r["invalidations"] >= STEPS // 2  # every switch of branch leaves the trace
        assert r["hits"] > 0
