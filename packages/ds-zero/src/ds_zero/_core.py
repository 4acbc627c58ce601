"""``GradientCore``: the one gradient step of every ZeRO stage: the accumulation window, the
backward pass around the layout's reduction, and the sequence norm -> non-finite check ->
clip -> optimizer step -> publish, reported as a :class:`ds_optim.StepResult`.

[Note: one step]
The core holds two strategies, chosen from ``ZeroConfig``'s flags by the public classes (and
``build_zero_optimizer``, ``_factory.py``): a :class:`Layout` (how gradients and fp32 masters
are laid out: ``_flat_layout.py``'s flat buckets for stages 0-2, ``_shard_layout.py``'s
per-parameter shards when ``shard_parameters``; ``_local.py``'s local gradients for optimizers
that reduce their own) and a :class:`~ds_zero._residency.Residency` (where parameters live:
whole, or partitioned with stage 3's gather/release hooks; ``_residency.py``'s [Note: parameter
residency]). ``ZeroOptimizer`` is the core with the flat layout and whole parameters,
``Stage3Optimizer`` the core with the shard layout and partitioned parameters; the core tests
neither the stage nor the strategies' types.

``backward(loss)`` scales the loss (loss scale / accumulation steps), arms the layout's reducer
(``reducer.begin``: whether this pass completes the window), runs autograd, waits for the
reductions (``reducer.finish``) and ends the residency's iteration (``residency.end_iteration``:
stage 3's prefetch trace). ``step()`` at the accumulation boundary:

1. reduces what backward left local (``reducer.flush``: stages 0/1 off the boundary);
2. takes the layout's fp32 gradients of the master partitions (``layout.master_grads``) and
   their global L2 norm (``layout.global_norm``, reduced over the data-parallel group and any
   norm group, so every rank sees the same value);
3. a non-finite norm skips the step on every rank (see ds-optim's [Note: one non-finite
   policy]): with a loss scaler the scale is lowered, without one a warning is logged; the
   gradients are zeroed and the result says ``overflow``;
4. scales the gradients once by ``1 / (loss_scale * clip)`` with DeepSpeed's clip rule
   ``clip = max(1, (norm + 1e-6) / gradient_clipping)`` on the unscaled norm;
5. steps the wrapped optimizer on the masters and publishes them into the model's parameters
   (``layout.apply``: the layout's write-back, gathers or shard copies, bracketed by the
   residency's ``before_publish``/``after_publish``), then zeroes the gradients
   (``reducer.zero``).

Both reducers (``_reduce.py``'s flat buckets, ``_shard_reduce.py``'s per-parameter shards) go
through ``_streams.py``'s collective queue and side stream. The sequence above, the window, the
counters and the core's part of a state dict (loss scaler, counters) are written once, here;
the layouts save and load the rest.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from ds_optim import StepResult
from ds_zero._residency import Residency

__all__ = ["GradientCore", "Layout", "Reducer"]

logger = logging.getLogger("ds_zero")


class Reducer(Protocol):
    """A layout's gradient storage and reduction, as the core drives it."""

    def begin(self, reduce: bool) -> None:
        """Arm the backward about to run (``reduce``: it completes the window)."""
        ...

    def finish(self) -> None:
        """After a backward: wait for its reductions."""
        ...

    def abort(self) -> None:
        """After a failed backward: drop what it started."""
        ...

    def flush(self) -> None:
        """Reduce what backward left local."""
        ...

    def zero(self) -> None:
        """Zero (or free) the gradients."""
        ...


class Layout(Protocol):
    """How gradients and masters are laid out (see [Note: one step]): flat buckets
    (``_flat_layout.py``) or per-parameter shards (``_shard_layout.py``)."""

    @property
    def reducer(self) -> Reducer:
        """The gradient storage and reduction."""
        ...

    def master_grads(self) -> list[torch.Tensor]:
        """The fp32 gradients of the master partitions."""
        ...

    def global_norm(self, grads: Sequence[torch.Tensor]) -> float:
        """Their L2 norm over every rank (the same value on every rank)."""
        ...

    def apply(self, grads: Sequence[torch.Tensor]) -> None:
        """Step the wrapped optimizer with ``grads`` and publish the masters."""
        ...


class GradientCore:
    """The accumulation window and the step sequence (see [Note: one step]) over a layout and
    a parameter residency.

    Args:
        layout: gradients, masters and write-back (flat buckets or per-parameter shards).
        residency: where parameters live (whole, or partitioned with gather/release hooks).
        optimizer: the wrapped optimizer (its param groups hold the layout's masters).
        loss_scaler: ds-optim's loss scaler for fp16 (None: no scaling).
        gradient_accumulation_steps: micro-batches per optimizer step.
        gradient_clipping: max global gradient norm (0: no clipping).
    """

    def __init__(
        self,
        layout: Layout,
        residency: Residency,
        *,
        optimizer: Any,
        loss_scaler: Any,
        gradient_accumulation_steps: int,
        gradient_clipping: float,
    ) -> None:
        self.layout, self.residency = layout, residency
        self.reducer = layout.reducer
        self.optimizer = optimizer
        self.loss_scaler = loss_scaler
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.gradient_clipping = float(gradient_clipping)
        self.micro_steps = 0  # backward passes
        self._window = 0  # backward passes since the last optimizer step
        self._backward_since_step = False
        self.global_steps = 0  # applied optimizer steps
        self.skipped_steps = 0
        self._boundary: bool | None = None
        self._grad_norm: float | None = None
        self.overflow = False  # the last step's gradients held inf/nan (DeepSpeed's attribute)
        self._last_result: StepResult | None = None

    # --- the window -----------------------------------------------------------------------------

    def _reduces_now(self) -> bool:
        """Whether the backward about to run completes the window (or the override says so)."""
        if self._boundary is not None:
            return self._boundary
        return self._window + 1 >= self.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch is the last of its accumulation window: before its
        backward, whether that backward completes the window; after it, whether ``step()``
        steps. The engines ask this instead of counting micro-batches themselves."""
        if self._boundary is not None:
            return self._boundary
        if self._backward_since_step:
            return self._window >= self.gradient_accumulation_steps
        return self._window + 1 >= self.gradient_accumulation_steps

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Override the boundary (pipeline schedules, ``no_sync``); None returns to counting
        backward passes. The override decides both whether backward reduces (stages 0/1) and
        whether ``step()`` steps."""
        self._boundary = is_boundary

    @property
    def boundary_override(self) -> bool | None:
        """The value set by :meth:`set_gradient_accumulation_boundary` (None: counting)."""
        return self._boundary

    def _step_due(self) -> bool:
        """Whether ``step()`` steps now: the window is complete (or the override says so)."""
        due = self._window >= self.gradient_accumulation_steps
        return self._boundary if self._boundary is not None else due

    # --- backward and step ----------------------------------------------------------------------

    def backward(
        self,
        loss: torch.Tensor | Sequence[torch.Tensor],
        *,
        retain_graph: bool = False,
        grad_tensors: Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        """Backpropagate ``loss * loss_scale / gradient_accumulation_steps`` and reduce gradients
        as the layout does.

        With ``grad_tensors`` (a pipeline stage that received the gradients of its outputs),
        ``loss`` is those outputs and the gradients are used as given: they carry the scaling
        already.
        """
        scale = self.loss_scale / self.gradient_accumulation_steps
        self.reducer.begin(self._reduces_now())
        try:
            if grad_tensors is not None:
                outputs = [loss] if torch.is_tensor(loss) else list(loss)
                torch.autograd.backward(outputs, list(grad_tensors), retain_graph=retain_graph)
            else:
                if not torch.is_tensor(loss):
                    (loss,) = loss  # a one-element sequence: the pipeline's [loss]
                (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
            self.reducer.finish()
        except BaseException:
            self.reducer.abort()
            raise
        finally:
            self.residency.end_iteration()
        self.micro_steps += 1
        self._window += 1
        self._backward_since_step = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (stages 0-2) or free (stage 3) every gradient; ``set_to_none`` is accepted for
        torch parity."""
        del set_to_none
        self.reducer.zero()

    def reduce_gradients(self) -> None:
        """Reduce what backward left local now (``step()`` does it anyway when due)."""
        self.reducer.flush()

    def step(self) -> StepResult:
        """Step once ``gradient_accumulation_steps`` backward passes were taken since the last
        step (or the boundary was set); otherwise do nothing, so it may be called after every
        micro-batch (DeepSpeed's engine contract) or once per window.

        Returns:
            What happened (see :class:`ds_optim.StepResult`); also :attr:`last_result`.
        """
        self._backward_since_step = False
        if not self._step_due():
            return self._record(StepResult.not_due(self.loss_scale))
        self._window = 0
        self.reducer.flush()
        grads = self.layout.master_grads()
        norm = self.layout.global_norm(grads)
        if not math.isfinite(norm):
            del grads  # freed before zero() allocates the next window's buffers
            return self._skip(norm)
        scale = self.loss_scale
        self._grad_norm = norm / scale
        combined = scale
        if self.gradient_clipping > 0:
            combined *= max(1.0, (self._grad_norm + 1e-6) / self.gradient_clipping)
        if combined != 1.0:
            torch._foreach_mul_(grads, 1.0 / combined)
        self.layout.apply(grads)
        del grads  # as above
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(False)
        self.reducer.zero()
        self.global_steps += 1
        self.overflow = False
        result = StepResult(
            boundary=True, applied=True, grad_norm=self._grad_norm, loss_scale=self.loss_scale
        )
        return self._record(result)

    def _skip(self, norm: float) -> StepResult:
        """Skip the step for non-finite gradients (every rank sees the same norm, so every rank
        skips; see ds-optim's [Note: one non-finite policy])."""
        self._grad_norm = norm
        self.overflow = True
        self.skipped_steps += 1
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(True)
        else:
            logger.warning(
                "the global gradient norm is %s: a gradient holds inf/nan, so the optimizer "
                "step was skipped on every rank (no loss scaler to lower; check the loss and the "
                "inputs)",
                norm,
            )
        self.reducer.zero()
        result = StepResult(
            boundary=True, applied=False, overflow=True, grad_norm=norm, loss_scale=self.loss_scale
        )
        return self._record(result)

    def _record(self, result: StepResult) -> StepResult:
        self._last_result = result
        return result

    @property
    def last_result(self) -> StepResult | None:
        """What the last :meth:`step` did (None before the first)."""
        return self._last_result

    def get_global_grad_norm(self) -> float | None:
        """L2 norm of the last step's unscaled gradients before clipping (inf/nan on overflow)."""
        return self._grad_norm

    # --- DeepSpeed's optimizer attributes -------------------------------------------------------

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without a loss scaler)."""
        return float(self.loss_scaler.loss_scale) if self.loss_scaler is not None else 1.0

    @property
    def cur_scale(self) -> float:
        """The current loss scale (DeepSpeed's other name for it)."""
        return self.loss_scale

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups (for LR schedulers)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state (keyed by the master tensors it steps),
        read by clients as they read a torch optimizer's (Lightning's teardown does)."""
        return self.optimizer.state

    # --- the core's part of a state dict --------------------------------------------------------

    def _core_state(self) -> dict[str, Any]:
        """The loss scaler's state and the counters (the layout saves the rest)."""
        return {
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            "counters": self._counters(),
        }

    def _load_core_state(self, source: Mapping[str, Any]) -> None:
        """Restore what :meth:`_core_state` saved into ``source``, then zero the gradients."""
        if self.loss_scaler is not None and source.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(source["loss_scaler"])
        self._load_counters(source.get("counters", {}))
        self.reducer.zero()

    def _counters(self) -> dict[str, int]:
        return {
            "micro_steps": self.micro_steps,
            "global_steps": self.global_steps,
            "skipped_steps": self.skipped_steps,
        }

    def _load_counters(self, counters: Any) -> None:
        self.micro_steps = int(counters.get("micro_steps", 0))
        self.global_steps = int(counters.get("global_steps", 0))
        self.skipped_steps = int(counters.get("skipped_steps", 0))
