"""One non-finite policy for every stage: an inf/nan gradient on one rank, without a loss
scaler, skips the step on every rank, leaves the weights untouched, says so in the
``StepResult`` and ``overflow`` and logs a warning; with a loss scaler it lowers the scale."""

from __future__ import annotations

import sys
from pathlib import Path

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _ds_zero_testing import adam, global_batches, make_model, micro_batches

STEPS, ROWS, BAD = 3, 8, 1


def _weights(zero, model) -> list:

    if zero.config.stage == 3:
        return [p.ds_tensor.detach().clone() for p in model.parameters()]
    return [p.detach().clone() for p in model.parameters()]


def _nonfinite_body(rank: int, world_size: int) -> dict:
    import logging

    import torch

    from ds_optim import StaticLossScaler
    from ds_zero import ZeroConfig, build_zero_optimizer

    warnings: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("ds_zero").addHandler(_Keep(logging.WARNING))
    seen = {}
    # with a loss scaler, stages 0, 2 and 3 are covered by the fp16 tests: here stage 1
    for stage, scaled in [(0, False), (1, False), (2, False), (3, False), (1, True)]:
        if True:
            model = make_model(torch.float32)
            config = ZeroConfig(stage=stage, reduce_bucket_size=1500)
            scaler = StaticLossScaler(4.0) if scaled else None
            zero = build_zero_optimizer(
                model, adam(list(model.parameters())), config, loss_scaler=scaler
            )
            results, unchanged = [], []
            warnings.clear()
            for step, batch in enumerate(global_batches(STEPS, ROWS)):
                loss = model(next(micro_batches(batch, rank, world_size, 1)))
                if step == BAD and rank == world_size - 1:
                    loss = loss * float("nan")  # only the last rank's gradient is non-finite
                before = _weights(zero, model)
                zero.backward(loss)
                result = zero.step()
                after = _weights(zero, model)
                unchanged.append(all(torch.equal(a, b) for a, b in zip(before, after)))
                assert zero.last_result is result and zero.overflow == result.overflow
                results.append((result.boundary, result.applied, result.overflow))
            finite = all(torch.isfinite(w).all() for w in _weights(zero, model))
            seen[(stage, scaled)] = {
                "results": results,
                "unchanged": unchanged,
                "finite": bool(finite),
                "warned": any("skipped on every rank" in w for w in warnings),
                "skipped_steps": zero.skipped_steps,
            }
    return seen


def test_a_nan_gradient_on_one_rank_skips_the_step_on_every_rank_at_every_stage() -> None:
    for seen in run_on_ranks(_nonfinite_body, 2, timeout=300):
        for (stage, scaled), got in seen.items():
            where = f"stage {stage}, loss scaler {scaled}"
            expected = [(True, step != BAD, step == BAD) for step in range(STEPS)]
            assert got["results"] == expected, where
            assert got["unchanged"] == [step == BAD for step in range(STEPS)], where
            assert got["finite"] and got["skipped_steps"] == 1, where
            assert got["warned"] is not scaled, where  # the scaler's lowered scale says it
