"""Loss scaling for fp16 training: DeepSpeed's dynamic rule, a static scaler, overflow checks.

[Note: the dynamic loss scale update rule]
DeepSpeed's rule (``fp16`` section; ``hysteresis`` is its "delayed shift"), applied once per
optimizer step by ``update_scale(overflow)``, with ``it`` counting calls from 0:

- overflow: if the hysteresis is spent (``hysteresis == 1`` or the remaining count is 1), the
  scale halves, not below ``min_loss_scale`` (an overflow already at the floor raises
  :class:`LossScaleAtMinimumError` when ``raise_error_at_min_scale``); otherwise the remaining
  count drops by one and the scale stays. Either way the step is skipped and ``it`` is recorded
  as the last overflow.
- no overflow: with ``consecutive_hysteresis`` the count is refilled at once. The scale doubles
  when ``it - last_overflow - 1`` is a positive multiple of ``loss_scale_window`` (the last
  overflow is -1 at the start): on the ``(window + 1)``-th clean step in a row, then every
  ``window`` clean steps. Without ``consecutive_hysteresis`` that is when the count is refilled.

[Note: an overflow on one rank skips the step on all]
Every rank must skip the same steps, or parameters drift apart. ``has_overflow(..., group=g)``
takes the inf-norm of this rank's gradients and all-reduces it over ``g`` with MAX (plus a nan
flag), so one rank's inf or nan is every rank's overflow; see ``_grad_norm.py`` for which group
to pass. With ``group=None`` only this rank's tensors are checked.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

import torch

from ds_optim._grad_norm import TensorsOrParams, global_grad_norm
from ds_optim.api import FP16Config, LossScaleAtMinimumError

__all__ = ["DynamicLossScaler", "StaticLossScaler", "build_loss_scaler", "has_overflow"]

logger = logging.getLogger("ds_optim")

SCALE_FACTOR = 2.0  # DeepSpeed halves and doubles; it exposes no knob for this


def has_overflow(grads_or_params: TensorsOrParams, group: Any = None) -> bool:
    """True when any gradient on any rank of ``group`` holds an inf or a nan.

    Args:
        grads_or_params: gradient tensors, or parameters (their ``.grad``; None is skipped).
        group: the ranks that must agree (see [Note: an overflow on one rank skips the step on
            all]); None checks this rank's tensors only. Every rank of the group must call this.

    Example:
        >>> if not has_overflow(model.parameters(), group=dp_group):
        ...     optimizer.step()
    """
    return not bool(torch.isfinite(global_grad_norm(grads_or_params, math.inf, group)))


class _LossScaler:
    """What both scalers share: scale the loss, check for overflow, save and restore."""

    dynamic = False

    def __init__(self, scale: float) -> None:
        self.cur_scale = float(scale)

    @property
    def loss_scale(self) -> float:
        """The current scale (DeepSpeed's name; ``cur_scale`` also works)."""
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale``, to call ``backward()`` on."""
        return loss * self.cur_scale

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backpropagate the scaled loss; the gradients come out multiplied by ``loss_scale``."""
        self.scale_loss(loss).backward(retain_graph=retain_graph)

    def has_overflow(self, grads_or_params: TensorsOrParams, group: Any = None) -> bool:
        """See :func:`ds_optim.has_overflow`."""
        return has_overflow(grads_or_params, group)

    def update_scale(self, overflow: bool) -> None:
        """Record one optimizer step's overflow verdict (a static scale never changes)."""

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self.cur_scale}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.cur_scale = float(state_dict["cur_scale"])


class StaticLossScaler(_LossScaler):
    """A fixed loss scale (the ``fp16`` section with ``loss_scale`` > 0).

    Overflow checks still work, so steps with inf/nan gradients can be skipped.

    Example:
        >>> scaler = StaticLossScaler(128.0)
        >>> scaler.backward(loss)
    """

    def __init__(self, scale: float = 1.0) -> None:
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise ValueError(f"loss_scale = {scale!r}: expected a positive finite number")
        super().__init__(scale)


class DynamicLossScaler(_LossScaler):
    """DeepSpeed's dynamic loss scale: halve on overflow (after hysteresis), double when stable.

    The rule is in [Note: the dynamic loss scale update rule]; the arguments are the ``fp16``
    section's keys.

    Args:
        initial_scale_power: start at ``2**initial_scale_power``.
        loss_scale_window: clean steps between doublings.
        hysteresis: overflows absorbed before the scale halves.
        consecutive_hysteresis: refill the hysteresis after every clean step.
        min_loss_scale: the floor of the scale.
        raise_error_at_min_scale: raise :class:`LossScaleAtMinimumError` on an overflow at the
            floor (DeepSpeed's behaviour) instead of skipping steps at the floor for ever.

    Example:
        >>> scaler = DynamicLossScaler(initial_scale_power=16)
        >>> scaler.backward(loss)
        >>> overflow = scaler.has_overflow(model.parameters(), group=dp_group)
        >>> if not overflow:
        ...     unscale_and_step()
        >>> scaler.update_scale(overflow)
    """

    dynamic = True

    def __init__(
        self,
        *,
        initial_scale_power: int = 16,
        loss_scale_window: int = 1000,
        hysteresis: int = 2,
        consecutive_hysteresis: bool = False,
        min_loss_scale: float = 1.0,
        raise_error_at_min_scale: bool = True,
    ) -> None:
        checked = FP16Config(  # the fp16 section's checks, with its key names in the errors
            initial_scale_power=initial_scale_power,
            loss_scale_window=loss_scale_window,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis,
            min_loss_scale=min_loss_scale,
        )
        super().__init__(2.0**checked.initial_scale_power)
        self.scale_window = checked.loss_scale_window
        self.delayed_shift = checked.hysteresis
        self.consecutive_hysteresis = checked.consecutive_hysteresis
        self.min_scale = checked.min_loss_scale
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = self.delayed_shift

    def update_scale(self, overflow: bool) -> None:
        """Apply [Note: the dynamic loss scale update rule] for one step."""
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise LossScaleAtMinimumError(
                        f"gradients overflowed at the minimum loss scale {self.min_scale}: "
                        "lower fp16.min_loss_scale, or find the inf/nan (e.g. a diverging "
                        "loss or a bad input)"
                    )
                next_scale = max(self.cur_scale / SCALE_FACTOR, self.min_scale)
                logger.info(
                    "fp16 overflow, skipping step: loss scale %g -> %g", self.cur_scale, next_scale
                )
                self.cur_scale = next_scale
            else:
                logger.info(
                    "fp16 overflow, skipping step: loss scale %g kept, hysteresis %d -> %d",
                    self.cur_scale,
                    self.cur_hysteresis,
                    self.cur_hysteresis - 1,
                )
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= SCALE_FACTOR
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.cur_iter = int(state_dict["cur_iter"])
        self.last_overflow_iter = int(state_dict["last_overflow_iter"])
        self.cur_hysteresis = int(state_dict["cur_hysteresis"])


def build_loss_scaler(
    fp16: FP16Config | Mapping[str, Any] | None = None,
) -> StaticLossScaler | DynamicLossScaler:
    """The scaler an ``fp16`` section asks for.

    Dynamic when enabled with ``loss_scale`` 0, static at ``loss_scale`` when enabled with a
    positive one, and a static scale of 1 when fp16 is off (bf16 and fp32 need no scaling).

    Example:
        >>> scaler = build_loss_scaler({"enabled": True, "initial_scale_power": 12})
    """
    config = fp16 if isinstance(fp16, FP16Config) else FP16Config.from_dict(fp16)
    if not config.enabled:
        return StaticLossScaler(1.0)
    if not config.dynamic_loss_scale:
        return StaticLossScaler(config.loss_scale)
    return DynamicLossScaler(
        initial_scale_power=config.initial_scale_power,
        loss_scale_window=config.loss_scale_window,
        hysteresis=config.hysteresis,
        consecutive_hysteresis=config.consecutive_hysteresis,
        min_loss_scale=config.min_loss_scale,
    )
