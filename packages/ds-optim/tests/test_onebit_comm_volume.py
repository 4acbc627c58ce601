"""Bytes on the wire, as the comms logger counts them: 1-bit Adam and 1-bit LAMB send ~1/32 of a
full-precision allreduce per step once compression starts, 0/1 Adam's collectives follow its
variance and local-step schedules, and a single process sends nothing."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_testing import run_on_ranks

_SIZES = (1000, 24, 3000)  # one param group of 4024 elements


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(n)) for n in _SIZES]


def _step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], step: int) -> None:
    """Set fresh local gradients (different on every rank and step) and step."""
    import ds_comm

    g = torch.Generator().manual_seed(1000 * step + ds_comm.get_rank())
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    optimizer.step()


def _logged(fn: Any) -> tuple[float, dict[str, int]]:
    """Wire bytes this rank sent while ``fn()`` ran, and the number of calls per op."""
    import ds_comm

    logger = ds_comm.get_comms_logger()
    previous = ds_comm.configure(enabled=True, prof_all=True)
    try:
        logger.reset()
        fn()
        counts: dict[str, int] = {}
        for record in logger.records:
            counts[record.op] = counts.get(record.op, 0) + 1
        return logger.total_wire_bytes(), counts
    finally:
        ds_comm.configure(previous)
        logger.reset()


def _freeze_then_compress_body(rank: int, world_size: int, *, name: str) -> float:
    import ds_optim

    params, warmup, compressed = _params(), 3, 5
    optimizer = getattr(ds_optim, name)(params, freeze_step=warmup)
    full_bytes, full_ops = _logged(lambda: [_step(optimizer, params, t) for t in range(warmup)])
    onebit_bytes, onebit_ops = _logged(
        lambda: [_step(optimizer, params, t) for t in range(warmup, warmup + compressed)]
    )
    if world_size == 1:
        assert full_bytes == onebit_bytes == 0 and not full_ops and not onebit_ops
        return 0.0
    assert full_ops == {"all_reduce": warmup}, full_ops
    assert onebit_ops == {
        "all_to_all_single": compressed,
        "all_gather_into_tensor": compressed,
    }, onebit_ops
    numel = sum(_SIZES)
    assert full_bytes == warmup * 4 * numel * 2 * (world_size - 1) / world_size
    ratio = (full_bytes / warmup) / (onebit_bytes / compressed)
    # 32x fewer bytes, less one fp32 scale per chunk and the padding to 8 * world_size elements.
    assert 30 < ratio <= 32, ratio
    return ratio


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("name", ["OneBitAdam", "OneBitLamb"])
def test_compression_sends_about_a_32nd_of_the_allreduce(name: str, world_size: int) -> None:
    ratios = run_on_ranks(_freeze_then_compress_body, world_size, name=name)
    assert len(set(ratios)) == 1


_ZERO_ONE = {
    "var_freeze_step": 12,
    "var_update_scaler": 2,
    "local_step_scaler": 4,
    "local_step_clipper": 4,
}
_ZERO_ONE_STEPS = 28


def _zero_one_expected_calls() -> tuple[int, int]:
    """(full allreduces, 1-bit allreduces) in the run, from the schedules of Lu et al. 2022 as
    DeepSpeed runs them.

    Variance phase: the steps divisible by the current interval update the variance (a full
    allreduce); the interval starts at 1 and doubles after every ``var_update_scaler`` updates;
    the other steps average 1-bit gradients. Local steps: the interval doubles every
    ``local_step_scaler`` steps, up to ``local_step_clipper``; the steps it divides synchronise.
    """
    freeze, scaler = _ZERO_ONE["var_freeze_step"], _ZERO_ONE["var_update_scaler"]
    full, interval = 0, 1
    for step in range(1, freeze + 1):
        if step % interval == 0:
            full += 1
            interval *= 2 if full % scaler == 0 else 1
    syncs = 0
    for i, step in enumerate(range(freeze + 1, _ZERO_ONE_STEPS + 1)):
        interval = min(_ZERO_ONE["local_step_clipper"], 2 ** (i // _ZERO_ONE["local_step_scaler"]))
        syncs += step % interval == 0
    return full, freeze - full + syncs


def _zero_one_body(rank: int, world_size: int) -> float:
    import ds_optim

    params = _params()
    optimizer = ds_optim.ZeroOneAdam(params, **_ZERO_ONE)
    total, ops = _logged(lambda: [_step(optimizer, params, t) for t in range(_ZERO_ONE_STEPS)])
    if world_size == 1:
        assert total == 0 and not ops
        return 0.0
    full, onebit = _zero_one_expected_calls()
    # Spelled out: variance at steps 1, 2, 4, 6, 8, 12; syncs at 13-16, 18, 20, 24, 28.
    assert (full, onebit) == (6, 14)
    assert ops == {
        "all_reduce": full,
        "all_to_all_single": onebit,
        "all_gather_into_tensor": onebit,
    }, ops
    adam_bytes = _ZERO_ONE_STEPS * 4 * sum(_SIZES) * 2 * (world_size - 1) / world_size
    return adam_bytes / total


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_zero_one_adam_communicates_on_its_schedule(world_size: int) -> None:
    reductions = run_on_ranks(_zero_one_body, world_size)
    if world_size > 1:
        # 28 allreduces' worth of bytes became 6 full ones and 14 of ~1/32 each.
        assert reductions[0] > 28 / (6 + 14 / 30), reductions
