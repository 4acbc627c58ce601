"""The accumulation window and the accessors every ZeRO optimizer shares (stages 0-2 and 3)."""

from __future__ import annotations

from typing import Any

__all__ = ["AccumulationWindow"]


class AccumulationWindow:
    """Counts backward passes towards ``gradient_accumulation_steps``, with an override.

    The host class sets ``gradient_accumulation_steps``, ``loss_scaler``, ``optimizer``,
    ``_window`` (backward passes since the last step) and ``_boundary`` (the override).
    """

    gradient_accumulation_steps: int
    loss_scaler: Any
    optimizer: Any
    _window: int
    _boundary: bool | None

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``backward()`` completes the accumulation window: its gradients are
        reduced (stages 0/1) and the ``step()`` after it steps."""
        if self._boundary is not None:
            return self._boundary
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

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without a loss scaler)."""
        return float(self.loss_scaler.loss_scale) if self.loss_scaler is not None else 1.0

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups (for LR schedulers)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state (keyed by the master tensors it steps),
        read by clients as they read a torch optimizer's (Lightning's teardown does)."""
        return self.optimizer.state
