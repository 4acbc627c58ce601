"""The checks every client test makes on a run's per-step losses."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

# fp32 runs do the same arithmetic as DeepSpeed up to summation order (bucketed reductions,
# another torch release): on the machine that recorded the references the differences are ~1e-7
# relative. On another CPU torch's kernels sum in another order, and the references themselves
# move: on an AMD EPYC without AVX-512 (2026-11-27) the Lightning run left them by 1.39e-5 at
# step 17, with ds's code unchanged since it passed at 5.4e-7. 3e-5 covers that and still catches
# any real divergence (one wrong step moves the loss by 1e-3 or more).
FP32_RTOL = 3e-5
# DeepSpeed's CPU Adam (its C++ kernel, used with offload_optimizer) rounds differently from
# torch.optim.AdamW: over these 20 steps its own losses leave its torch-AdamW run's by 3.9e-5
# (reference trainer_offload vs trainer_zero2), while ds's CPU Adam stays within 2e-7 of them.
CPU_ADAM_RTOL = 1e-4
# bf16 rounds every parameter to 8 mantissa bits after each step, so once the weights differ in
# one ulp (a summation-order difference in a bf16 reduction) the trajectories drift apart: ds and
# DeepSpeed agree exactly for 4 steps, then by up to 6e-4. bf16 itself moves DeepSpeed's losses
# 3.7e-3 from its fp32 run. The first step, before any update, is held to FP32_RTOL instead.
BF16_RTOL = 2e-3
# A run resumed from a checkpoint against the uninterrupted one, both under ds: the same
# arithmetic on the same restored state, so only summation-order noise is allowed.
RESUME_RTOL = 1e-6


def max_relative_difference(
    losses: Sequence[Sequence[float]], expected: Sequence[Sequence[float]]
) -> float:
    """Largest ``|a - b| / |b|`` over ranks and steps; the step counts must agree."""
    assert len(losses) == len(expected), f"{len(losses)} ranks reported, expected {len(expected)}"
    worst = 0.0
    for rank, (ours, theirs) in enumerate(zip(losses, expected)):
        assert len(ours) == len(theirs), f"rank {rank}: {len(ours)} steps, expected {len(theirs)}"
        for a, b in zip(ours, theirs):
            worst = max(worst, abs(a - b) / abs(b))
    return worst


def assert_matches(
    losses: Sequence[Sequence[float]], expected: Sequence[Sequence[float]], rtol: float, what: str
) -> None:
    """Every rank's every step within ``rtol`` of ``expected``; the message shows both series."""
    worst = max_relative_difference(losses, expected)
    assert worst <= rtol, (
        f"{what}: max relative difference {worst:.3g} > {rtol:g}\n"
        f"  ds rank 0:        {[round(x, 6) for x in losses[0]]}\n"
        f"  expected rank 0:  {[round(x, 6) for x in expected[0]]}"
    )


def assert_loss_falls(losses: Sequence[Sequence[float]]) -> None:
    """Training trained: on every rank the last 5 steps average well below the first 5."""
    for rank, series in enumerate(losses):
        first, last = sum(series[:5]) / 5, sum(series[-5:]) / 5
        assert last < 0.95 * first, f"rank {rank}: loss did not fall ({first:.4f} -> {last:.4f})"


def assert_reloads_exactly(out: Path) -> None:
    """``from_pretrained(out/final)`` (no DeepSpeed involved) gives exactly the weights rank 0
    dumped to ``out/weights.rank0.pt`` from the trained engine."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    trained = torch.load(out / "weights.rank0.pt", weights_only=True)
    reloaded = model.state_dict()
    assert sorted(reloaded) == sorted(trained)
    for key, tensor in trained.items():
        assert torch.equal(reloaded[key].float(), tensor), f"{key} differs after the reload"
