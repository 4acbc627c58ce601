"""Lightning's ``DeepSpeedStrategy`` (ZeRO-2) on ds, 2 CPU ranks (``run_lightning.py``).

Compared step by step with the losses real DeepSpeed 0.19.8 produced for the same script.
"""

from __future__ import annotations

from _compare import FP32_RTOL, assert_loss_falls, assert_matches


def test_lightning_deepspeed_strategy_trains_like_deepspeed(scenario, reference) -> None:
    run = scenario("lightning_zero2")
    assert_loss_falls(run.losses)
    expected = reference["lightning_zero2"]
    assert_matches(run.losses, expected["losses"], FP32_RTOL, "lightning_zero2 vs DeepSpeed 0.19.8")
    for rank, result in enumerate(run.results):
        assert {k: result[k] for k in expected["reported"][rank]} == expected["reported"][rank]
