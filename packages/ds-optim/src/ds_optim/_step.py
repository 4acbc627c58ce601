"""``StepResult`` and ``GradientStep``: what one gradient step reports, and the protocol the
engines drive a gradient step through.

They live here, below ds-zero and ds-pipe, so that ds-zero's gradient-step core can return the
result and ds-pipe's pipeline engine can drive the core without either importing the other
(ds-engine builds the core and hands it to the pipeline engine).

[Note: one non-finite policy]
DeepSpeed's behaviour is the reference. With a loss scaler, an inf/nan gradient is an fp16
overflow: the step is skipped and the scale lowered. Without one the step is skipped too (the
weights never take a non-finite value), reported in the :class:`StepResult` and as a warning.
The decision is taken from the global gradient norm, which is reduced over the data-parallel
group (and the pipeline group), so every rank takes the same decision.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

__all__ = ["GradientStep", "StepResult"]


@dataclass(frozen=True)
class StepResult:
    """What one call of a gradient step's ``step()`` did.

    Attributes:
        boundary: the call was at the accumulation boundary (False: nothing was due, nothing
            happened).
        applied: the optimizer stepped and the weights changed.
        overflow: a gradient held inf/nan (on some rank): the step was skipped on every rank
            (see [Note: one non-finite policy]).
        grad_norm: the global L2 norm of the unscaled gradients before clipping (inf/nan on
            overflow; None when no step was due).
        loss_scale: the loss scale after the step (1.0 without a loss scaler).

    Example:
        >>> result = zero.step()
        >>> if result.boundary and not result.applied:
        ...     print("skipped, norm", result.grad_norm)
    """

    boundary: bool
    applied: bool
    overflow: bool = False
    grad_norm: float | None = None
    loss_scale: float = 1.0

    @property
    def skipped(self) -> bool:
        """A step was due and did not change the weights (non-finite gradients)."""
        return self.boundary and not self.applied

    @classmethod
    def not_due(cls, loss_scale: float = 1.0) -> StepResult:
        """The result of a ``step()`` off the accumulation boundary."""
        return cls(boundary=False, applied=False, loss_scale=loss_scale)


@runtime_checkable
class GradientStep(Protocol):
    """The gradient step the engines drive (ds-zero's core satisfies it).

    One ``backward`` per micro-batch; ``step`` after each (it only steps at the accumulation
    boundary, which the step itself keeps); ``reduce_gradients`` where a schedule reduces
    before stepping (a no-op for a step that reduces inside ``step``).
    """

    optimizer: torch.optim.Optimizer
    loss_scaler: Any
    gradient_accumulation_steps: int

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without a loss scaler)."""
        ...

    @property
    def last_result(self) -> StepResult | None:
        """What the last :meth:`step` did (None before the first)."""
        ...

    def backward(
        self,
        loss: torch.Tensor | Sequence[torch.Tensor],
        *,
        retain_graph: bool = False,
        grad_tensors: Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        """Backpropagate one micro-batch: ``loss`` (unscaled; the step scales it by the loss
        scale over the accumulation steps), or a pipeline stage's outputs with the gradients
        received for them (``grad_tensors``, scaled already)."""
        ...

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``backward`` completes the accumulation window."""
        ...

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Override the boundary (pipeline schedules, ``no_sync``); None: count."""
        ...

    @property
    def boundary_override(self) -> bool | None:
        """The value set by :meth:`set_gradient_accumulation_boundary` (None: counting)."""
        ...

    def reduce_gradients(self) -> None:
        """Reduce what backward left local (the step does it anyway when due)."""
        ...

    def step(self) -> StepResult:
        """At the boundary: norm, non-finite check, clip, optimizer step, publish, zero."""
        ...

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the accumulated gradients."""
        ...

    def get_global_grad_norm(self) -> float | None:
        """The last step's norm of the unscaled gradients before clipping."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (masters, optimizer state, loss scaler, counters)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        ...

    def memory_breakdown(self) -> Any:
        """Bytes this rank holds for parameters, gradients and optimizer state."""
        ...
