"""A confidence interval for a median that assumes nothing about the distribution, and what it
says of a target (tools/bench/checkpoint_verify.py: the verification overhead of each process).

[Note: the median's interval]
Of n values drawn from one distribution, each falls below the population's median with chance
1/2, so the count below it is Binomial(n, 1/2). The k-th smallest and the k-th largest values
then bracket the median with probability 1 - 2 P(Binomial(n, 1/2) < k), whatever the
distribution: the interval for the largest k that keeps that at or above the confidence asked
for. It needs no normal model, which per-process overheads (a few processes far off, a skewed
spread on a shared machine) do not follow. At 95% it needs 6 values (k = 1: the lowest and the
highest, 96.9%); at 60 values k is 22.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MedianInterval", "median_interval", "against_target"]


@dataclass(frozen=True)
class MedianInterval:
    """``[low, high]`` holds the population's median with chance ``coverage``; they are the
    ``rank``-th smallest and largest of the values."""

    low: float
    high: float
    coverage: float
    rank: int


def median_interval(values: Sequence[float], confidence: float = 0.95) -> MedianInterval | None:
    """The distribution-free interval for the median of the population ``values`` come from
    (see [Note: the median's interval]); None when there are too few values to reach
    ``confidence`` (fewer than 6 at 95%)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence}: give a fraction between 0 and 1, such as 0.95")
    ordered = sorted(values)
    n = len(ordered)
    below = 0.0  # P(Binomial(n, 1/2) < rank)
    rank = 0
    while rank < n // 2:
        step = math.comb(n, rank) / 2**n
        if 1 - 2 * (below + step) < confidence:
            break
        below += step
        rank += 1
    if rank == 0:
        return None
    return MedianInterval(ordered[rank - 1], ordered[n - rank], 1 - 2 * below, rank)


def against_target(interval: MedianInterval | None, target: float) -> str:
    """What ``interval`` says of a median that should stay under ``target``: met, missed, or
    not settled by this many values."""
    if interval is None:
        return "not settled: too few values for the interval"
    if interval.high < target:
        return "met: the whole interval is under the target"
    if interval.low >= target:
        return "missed: the whole interval is at or over the target"
    return "not settled: the interval straddles the target (more values narrow it)"
