"""Reduction options: ``gradient_predivide_factor`` only moves where the averaging happens, and
``communication_data_type`` runs the gradient collectives in another dtype, on stages 0/1/2.

Each body compares the reduced gradient of this rank's master partition (what the optimizer
steps on) with a single-process reference laid out the same way, computed inside the rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _ds_zero_testing import global_batches, make_model, micro_batches

BUCKET = 1500  # cuts the model into many units
ROWS_PER_MICRO_BATCH = 4
PREDIVIDE_TOLERANCE = 1e-6  # fp32 rounding, relative to the largest element
FP32_TOLERANCE = 1e-5  # against the single-process gradient (summation order differs)
BF16_TOLERANCE = 1e-2  # bf16 summation in the collective (a few roundings of 2**-9)


def _reduced_partitions(rank: int, world_size: int, *, stage: int, accum: int, **options):
    """One accumulation window's reduced gradient of each group's master partition."""
    import torch

    from ds_zero import ZeroConfig, ZeroOptimizer

    model = make_model(torch.float32)
    section = {"stage": stage, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET}
    zero = ZeroOptimizer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        ZeroConfig.from_dict({**section, "overlap_comm": stage == 2}),
        gradient_accumulation_steps=accum,
        **options,
    )
    batch = global_batches(1, ROWS_PER_MICRO_BATCH * world_size * accum)[0]
    for micro in micro_batches(batch, rank, world_size, accum):
        zero.backward(model(micro))
    return zero, [zero.layout._master_grad(g).clone() for g in zero.groups]


def _reference_partitions(zero, world_size: int, *, accum: int, bf16_inputs: bool = False):
    """The average of every rank's gradient (each rounded to bf16 first with ``bf16_inputs``),
    laid out as ``zero``'s master partitions."""
    import torch

    model = make_model(torch.float32)
    batch = global_batches(1, ROWS_PER_MICRO_BATCH * world_size * accum)[0]
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for chunk in batch.chunk(world_size * accum):
        model.zero_grad()
        model(chunk).backward()
        for name, p in model.named_parameters():
            grad = p.grad.bfloat16().float() if bf16_inputs else p.grad
            total[name] += grad / (world_size * accum)
    names = {p: n for n, p in zero.module.named_parameters()}
    partitions = []
    for group in zero.groups:
        flat = torch.zeros(group.numel)
        partition = torch.zeros(group.partition_numel)
        for unit in group.units:
            for i, p in enumerate(unit.params):
                unit.param_view(flat, i).copy_(total[names[p]])
            unit.in_partition(partition).copy_(unit.shard(flat, zero.shard_rank))
        partitions.append(partition)
    return partitions


def _relative_error(actual, expected) -> float:
    return max(float((a - e).abs().max() / e.abs().max()) for a, e in zip(actual, expected))


def _predivide_body(rank: int, world_size: int, *, stage: int) -> dict:
    accum = 2  # stage 2 also accumulates reduced shards across micro-batches
    errors = {}
    _, default = _reduced_partitions(rank, world_size, stage=stage, accum=accum)
    for factor in (1.0, 4.0, 3.0):
        zero, grads = _reduced_partitions(
            rank, world_size, stage=stage, accum=accum, gradient_predivide_factor=factor
        )
        errors[factor] = _relative_error(grads, default)
    errors["reference"] = _relative_error(
        default, _reference_partitions(zero, world_size, accum=accum)
    )
    return errors


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_predivide_factor_gives_the_same_average(world_size: int, stage: int) -> None:
    for errors in run_on_ranks(_predivide_body, world_size, stage=stage, timeout=300):
        assert errors[1.0] <= PREDIVIDE_TOLERANCE, errors
        assert errors[4.0] <= PREDIVIDE_TOLERANCE, errors
        # Dividing by 3 is inexact in binary: the last bits move, so the factor was applied.
        assert errors[3.0] <= PREDIVIDE_TOLERANCE, errors
        assert (errors[3.0] > 0) == (world_size > 1), errors
        assert errors["reference"] <= FP32_TOLERANCE, errors


def _bf16_comm_body(rank: int, world_size: int, *, stage: int) -> dict:
    import ds_comm

    previous = ds_comm.configure(ds_comm.CommsLoggerConfig(enabled=True))
    logger = ds_comm.get_comms_logger()
    logger.reset()
    try:
        zero, grads = _reduced_partitions(
            rank, world_size, stage=stage, accum=1, communication_data_type="bf16"
        )
        reductions = [r for r in logger.records if r.op in ("all_reduce", "reduce_scatter_tensor")]
    finally:
        ds_comm.configure(previous)
        logger.reset()
    units = [u for g in zero.groups for u in g.units]
    return {
        "error": _relative_error(
            grads, _reference_partitions(zero, world_size, bf16_inputs=True, accum=1)
        ),
        "bf16_values": all(bool((g == g.bfloat16().float()).all()) for g in grads),
        "dtypes": {g.dtype for g in grads},
        "collectives": len(reductions),
        "units": len(units),
        "bytes": sum(r.msg_bytes for r in reductions),
        "bf16_bytes": sum(2 * u.padded_numel for u in units),
    }


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_bf16_communication_rounds_fp32_gradients(world_size: int, stage: int) -> None:
    import torch

    for result in run_on_ranks(_bf16_comm_body, world_size, stage=stage, timeout=300):
        assert result["error"] <= BF16_TOLERANCE, result
        assert result["bf16_values"], result  # the average itself went through bf16
        assert result["dtypes"] == {torch.float32}, result  # and was cast back
        assert result["collectives"] == result["units"], result
        assert result["bytes"] == result["bf16_bytes"], result  # 2-byte elements on the wire


def _bad_options_body(rank: int, world_size: int) -> list[str]:
    import torch

    from ds_zero import ZeroOptimizer

    messages = []
    for options in ({"gradient_predivide_factor": 0.0}, {"communication_data_type": "fp8"}):
        model = make_model(torch.float32)
        try:
            ZeroOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1), **options)
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_bad_options_name_the_argument_and_the_value() -> None:
    messages = run_on_ranks(_bad_options_body, 1)[0]
    assert len(messages) == 2
    assert messages[0].startswith("gradient_predivide_factor = 0.0")
    assert messages[1].startswith("communication_data_type = 'fp8'")
