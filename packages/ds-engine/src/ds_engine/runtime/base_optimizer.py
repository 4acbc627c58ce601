"""``deepspeed.runtime.base_optimizer``: ``DeepSpeedOptimizer``, the class DeepSpeed's wrapped
optimizers share, for ``isinstance`` checks (Lightning's DeepSpeed strategy makes one).

ds's ZeRO optimizers do not share a base class with DeepSpeed's names; they are registered as
virtual subclasses, so ``isinstance(opt, DeepSpeedOptimizer)`` is True for each of them.
"""

from __future__ import annotations

import abc

import ds_zero


class DeepSpeedOptimizer(abc.ABC):  # noqa: B024  (a marker for isinstance, no abstract method)
    """Any optimizer wrapper of ds's engine (ZeRO stages 0-2 and 3)."""


class ZeROOptimizer(DeepSpeedOptimizer):
    """A ZeRO optimizer wrapper (``ds_zero.ZeroOptimizer`` or ``ds_zero.Stage3Optimizer``)."""


for _cls in (ds_zero.ZeroOptimizer, ds_zero.Stage3Optimizer):
    ZeROOptimizer.register(_cls)

__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer"]
