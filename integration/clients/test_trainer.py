"""Hugging Face ``Trainer`` with ``TrainingArguments(deepspeed=...)`` on ds, 2 CPU ranks.

Each scenario runs the real transformers and accelerate against the opt-in ``deepspeed`` package
(see ``run_trainer.py`` for what each does) and is compared step by step with the losses real
DeepSpeed 0.19.8 produced for the same script, seed and data (``reference.json``).
"""

from __future__ import annotations

import pytest
from _compare import (
    BF16_RTOL,
    CPU_ADAM_RTOL,
    FP32_RTOL,
    RESUME_RTOL,
    assert_loss_falls,
    assert_matches,
    assert_reloads_exactly,
)


@pytest.mark.parametrize(
    ("name", "rtol"),
    [
        ("trainer_zero2", FP32_RTOL),
        ("trainer_zero3", FP32_RTOL),
        # ZeRO-Offload is trained by ds-engine's own tests by default; through the Trainer: slow.
        pytest.param("trainer_offload", CPU_ADAM_RTOL, marks=pytest.mark.slow),
        ("trainer_bf16", BF16_RTOL),
    ],
)
def test_trainer_trains_like_deepspeed(scenario, reference, name: str, rtol: float) -> None:
    run = scenario(name)
    assert_loss_falls(run.losses)
    assert_matches(run.losses, reference[name]["losses"], rtol, f"{name} vs DeepSpeed 0.19.8")


def test_zero3_builds_the_model_partitioned_as_deepspeed_does(scenario, reference) -> None:
    """transformers builds the model inside ``deepspeed.zero.Init``: nothing is materialized.

    After training, only the parameters under the persistence threshold (which the Trainer
    resolves from ``"auto"``) stay whole on every rank, the same ones as under DeepSpeed.
    """
    run = scenario("trainer_zero3")
    expected = reference["trainer_zero3"]["reported"]
    for rank, result in enumerate(run.results):
        assert result["built"]["full_numel"] == expected[rank]["built"]["full_numel"]
        assert result["built"]["local_numel"] == 0, f"rank {rank}: zero.Init left {result['built']}"
        assert result["trained"] == expected[rank]["trained"], f"rank {rank}"


def test_bf16_keeps_buffers_in_fp32_as_deepspeed_does(scenario, reference) -> None:
    """Parameters go to bf16, buffers (Llama's rotary ``inv_freq``) stay fp32: the first step,
    computed before any update, then gives DeepSpeed's loss to fp32 precision."""
    run = scenario("trainer_bf16")
    expected = reference["trainer_bf16"]
    for rank, result in enumerate(run.results):
        assert result["buffers"] == expected["reported"][rank]["buffers"], f"rank {rank}"
    first = [series[:1] for series in run.losses]
    assert_matches(first, [series[:1] for series in expected["losses"]], FP32_RTOL, "bf16 step 1")


def test_resume_from_checkpoint_continues_the_trajectory(scenario, reference) -> None:
    """``train(resume_from_checkpoint=checkpoint-10)`` replays steps 11-20 of the full run."""
    full = scenario("trainer_zero2")
    resumed = scenario("trainer_resume")
    continued = [series[10:] for series in full.losses]
    assert_matches(resumed.losses, continued, RESUME_RTOL, "resumed run vs uninterrupted run")
    expected = reference["trainer_resume"]["losses"]
    assert_matches(resumed.losses, expected, FP32_RTOL, "resumed run vs DeepSpeed 0.19.8")


@pytest.mark.parametrize("name", ["trainer_zero2", "trainer_zero3"])
def test_save_model_reloads_with_plain_from_pretrained(scenario, name: str) -> None:
    """``trainer.save_model()`` writes weights that ``from_pretrained`` (no DeepSpeed) reloads
    exactly: the trained values, gathered from every rank at ZeRO-3."""
    assert_reloads_exactly(scenario(name).out)
