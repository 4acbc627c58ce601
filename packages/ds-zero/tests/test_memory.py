"""Memory accounting: the bytes each rank holds equal the ZeRO table, and DeepSpeed's estimators."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks
from ds_zero import (
    MemoryBreakdown,
    estimate_model_states,
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    model_states_table,
)

sys.path.insert(0, str(Path(__file__).parent))
from _ds_zero_testing import adam, global_batches, make_model, micro_batches

CASES = [
    (stage, dtype, offload)
    for stage in (0, 1, 2)
    for dtype in ("float32", "bfloat16")
    for offload in (False, True)
    if not (stage == 0 and offload)
]


def _measured_body(rank: int, world_size: int) -> list[tuple]:
    import torch

    from ds_zero import ZeroConfig, ZeroOptimizer

    results = []
    for stage, dtype_name, offload in CASES:
        dtype = getattr(torch, dtype_name)
        model = make_model(dtype)
        numel = sum(p.numel() for p in model.parameters())
        config = ZeroConfig.from_dict(
            {"stage": stage, "offload_optimizer": {"device": "cpu" if offload else "none"}}
        )
        zero = ZeroOptimizer(model, adam(list(model.parameters())), config)
        batch = global_batches(1, 4 * world_size)[0]
        zero.backward(model(next(micro_batches(batch, rank, world_size, 1))))
        zero.step()  # creates Adam's state
        # One unit (the default 5e8-element bucket), padded to a multiple of 2 x shards.
        shards = world_size if stage else 1
        padded = -(-numel // (2 * shards)) * (2 * shards)
        expected = estimate_model_states(
            padded,
            stage=stage,
            world_size=world_size,
            param_bytes=dtype.itemsize,
            offload=offload,
        )
        measured = zero.memory_breakdown()
        results.append((stage, dtype_name, offload, measured, expected))
    return results


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_measured_bytes_equal_the_theory_for_each_stage(world_size: int) -> None:
    for stage, dtype, offload, measured, expected in run_on_ranks(
        _measured_body, world_size, timeout=300
    )[-1]:
        what = f"stage {stage} {dtype} offload={offload} on {world_size} ranks"
        assert measured.params == expected.params, what
        assert measured.grads == expected.grads, what
        assert measured.optimizer_state == expected.optimizer_state, what
        assert measured.host == expected.host, what


def test_theory_matches_the_zero_paper() -> None:
    psi, n = 8 * 10**6, 8
    mixed = [
        estimate_model_states(psi, stage=s, world_size=n).model_states / psi for s in (0, 1, 2)
    ]
    assert mixed == [16, 4 + 12 / n, 2 + 14 / n]
    fp32 = [
        estimate_model_states(psi, stage=s, world_size=n, param_bytes=4).model_states / psi
        for s in (0, 1, 2)
    ]
    assert fp32 == [16, 8 + 12 / n, 4 + 16 / n]
    offloaded = estimate_model_states(psi, stage=2, world_size=n, offload=True)
    assert offloaded == MemoryBreakdown(
        params=2 * psi,
        grads=4 * psi // n,
        optimizer_state=12 * psi // n,
        host=16 * psi // n,
    )


def test_table_lists_every_stage_and_precision() -> None:
    table = model_states_table(4)
    assert table.count("\n") == 11  # header, rule, 10 rows
    assert "| bf16/fp16 + fp32 master | 2 | none | 2 | 0.5 | 3 | 5.5 | 0 |" in table


def test_deepspeed_zero2_estimator_formulas() -> None:
    cpu, gpu = estimate_zero2_model_states_mem_needs(10**9, num_gpus_per_node=8, cpu_offload=False)
    assert (cpu, gpu) == (int(10**9 * 4 * 8 * 1.5), 2 * 10**9 + int(18 * 10**9 / 8))
    cpu, gpu = estimate_zero2_model_states_mem_needs(10**9, num_gpus_per_node=2, num_nodes=2)
    assert (cpu, gpu) == (int(10**9 * 16 * 1.5), 2 * 10**9)
    cpu, _ = estimate_zero2_model_states_mem_needs(10**9, num_gpus_per_node=8, num_nodes=2)
    assert cpu == int(10**9 * 4 * 16 * 1.5)


def test_deepspeed_zero2_tables(capsys: pytest.CaptureFixture[str]) -> None:
    text = estimate_zero2_model_states_mem_needs_all_cold(10**9, num_gpus_per_node=8)
    assert capsys.readouterr().out.strip() == text.strip()
    assert "SW: Model with 1000M total params." in text
    assert "offload_optimizer=none" in text
    model = make_model(__import__("torch").float32)
    live = estimate_zero2_model_states_mem_needs_all_live(model)
    unique = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())
    assert f"SW: Model with {int(unique / 1e6)}M total params." in live
