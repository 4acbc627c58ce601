"""Accelerate's DeepSpeed integration on ds, 2 CPU ranks: the plugin given in code, and the
plugin read from an ``accelerate launch`` config file (``accelerate_zero2.yaml``, and
``accelerate_zero3.yaml`` with ``zero3_init_flag``).

The training loop is ``run_accelerate.py``; its per-step losses are compared with those real
DeepSpeed 0.19.8 produced for the same script (``reference.json``).
"""

from __future__ import annotations

import pytest
from _compare import (
    FP32_RTOL,
    RESUME_RTOL,
    assert_loss_falls,
    assert_matches,
    assert_reloads_exactly,
)

SETTINGS = ("zero_stage", "accumulation", "global_steps")


# ZeRO-3 reduce-scatters in another bucket order than DeepSpeed's: the losses agree exactly for
# 4 steps, then differ by 1e-7, and at this loop's constant lr of 1e-2 (no warmup, no decay) that
# grows to 1.3e-5 by step 20 (measured), smoothly, step by step. A wrong step moves the loss by
# 1e-3 or more.
ZERO3_RTOL = 5e-5


@pytest.mark.parametrize(
    ("name", "rtol"),
    [
        ("accelerate_plugin", FP32_RTOL),
        ("accelerate_launch", FP32_RTOL),
        ("accelerate_zero3", ZERO3_RTOL),
    ],
)
def test_accelerate_trains_like_deepspeed(scenario, reference, name: str, rtol: float) -> None:
    run = scenario(name)
    assert_loss_falls(run.losses)
    assert_matches(run.losses, reference[name]["losses"], rtol, f"{name} vs DeepSpeed 0.19.8")
    # The engine took the settings the plugin (or the config file) gave: stage, accumulation,
    # and so the number of optimizer steps taken.
    for rank, result in enumerate(run.results):
        expected = reference[name]["reported"][rank]
        assert {k: result[k] for k in SETTINGS} == {k: expected[k] for k in SETTINGS}, (
            f"rank {rank}"
        )


def test_accelerate_save_state_load_state_replays_the_run(scenario, reference) -> None:
    """``save_state`` after 10 steps, ``load_state`` after 20: the last 10 steps repeat."""
    run = scenario("accelerate_plugin")
    replayed = [result["replayed"] for result in run.results]
    continued = [series[10:] for series in run.losses]
    assert_matches(replayed, continued, RESUME_RTOL, "replay after load_state vs first pass")
    expected = [r["replayed"] for r in reference["accelerate_plugin"]["reported"]]
    assert_matches(replayed, expected, FP32_RTOL, "replay vs DeepSpeed 0.19.8")


@pytest.mark.parametrize("name", ["accelerate_plugin", "accelerate_zero3"])
def test_accelerate_get_state_dict_save_pretrained_reloads(scenario, name: str) -> None:
    """``get_state_dict`` + ``save_pretrained`` reload exactly with a plain ``from_pretrained``
    (at ZeRO-3 the weights are gathered from both ranks first)."""
    assert_reloads_exactly(scenario(name).out)


def test_accelerate_zero3_init_flag_builds_the_model_partitioned(scenario) -> None:
    """With ``zero3_init_flag`` the model is built inside ``zero.Init``: nothing materialized."""
    for rank, result in enumerate(scenario("accelerate_zero3").results):
        assert result["built_local_numel"] == 0, f"rank {rank}: {result['built_local_numel']}"
