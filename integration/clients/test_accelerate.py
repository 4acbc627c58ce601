"""Accelerate's DeepSpeed integration on ds, 2 CPU ranks: the plugin given in code, and the
plugin read from an ``accelerate launch`` config file (``accelerate_zero2.yaml``).

The training loop is ``run_accelerate.py``; its per-step losses are compared with those real
DeepSpeed 0.19.8 produced for the same script (``reference.json``).
"""

from __future__ import annotations

import pytest
from _compare import FP32_RTOL, assert_loss_falls, assert_matches


@pytest.mark.parametrize("name", ["accelerate_plugin", "accelerate_launch"])
def test_accelerate_trains_like_deepspeed(scenario, reference, name: str) -> None:
    run = scenario(name)
    assert_loss_falls(run.losses)
    assert_matches(run.losses, reference[name]["losses"], FP32_RTOL, f"{name} vs DeepSpeed 0.19.8")
    # The engine took the settings the plugin (or the config file) gave: stage, accumulation,
    # and so the number of optimizer steps taken.
    for rank, result in enumerate(run.results):
        expected = reference[name]["reported"][rank]
        assert {k: result[k] for k in expected} == expected, f"rank {rank}"
