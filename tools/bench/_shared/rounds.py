"""``best_of_rounds``: every mode once per round, in turn, keeping each mode's fastest round
(tools/bench/zeropp.py and moe_zero3.py): a load spike on a shared machine hits one round of
every mode alike instead of all rounds of one mode."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["best_of_rounds"]


def best_of_rounds(
    modes: Sequence[str], run: Callable[[str], Mapping[str, Any]], rounds: int, *, verbose: bool
) -> dict[str, Mapping[str, Any]]:
    """``run(mode)`` for every mode in each of ``rounds`` rounds; per mode, the result with the
    smallest ``step_s``. ``verbose``: print each round's time (rank 0)."""
    results: dict[str, Mapping[str, Any]] = {}
    for round_ in range(rounds):
        for mode in modes:
            result = run(mode)
            best = results.get(mode)
            if best is None or result["step_s"] < best["step_s"]:
                results[mode] = result
            if verbose:
                print(f"round {round_ + 1}: {mode} {result['step_s']:.3f} s/step", flush=True)
    return results
