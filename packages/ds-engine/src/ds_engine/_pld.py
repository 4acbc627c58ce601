"""Progressive layer dropping (PLD): the keep-probability schedule the engine hands the model.

[Note: progressive layer drop]
PLD (Zhang & He, 2020, https://arxiv.org/abs/2010.13369) skips transformer layers with a
probability that grows during training. The engine owns only the schedule: the global keep
ratio ``theta(t) = (1 - theta) * exp(-gamma * t) + theta``, starting at 1.0 (keep everything)
and decaying towards the configured ``theta``. At each optimizer step boundary, before the step
is counted, the engine sets ``t`` to the number of steps taken so far (as DeepSpeed does, so the
first two steps both see 1.0); each training forward then receives
``progressive_layer_drop=True, pld_theta=theta(t)`` as keyword arguments. Which layers to skip
with that ratio is the model's business (DeepSpeed's BERT example drops layer ``i`` of ``L``
with probability ``(i + 1) / L * (1 - pld_theta)``).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["ProgressiveLayerDrop"]


class ProgressiveLayerDrop:
    """DeepSpeed's ``ProgressiveLayerDrop`` (see [Note: progressive layer drop]).

    Args:
        theta: the keep ratio the schedule decays towards (lower trains faster).
        gamma: how fast it decays.

    Example:
        >>> pld = ProgressiveLayerDrop(theta=0.5, gamma=0.01)
        >>> pld.update_state(100)
        >>> round(pld.get_theta(), 4)
        0.6839
    """

    def __init__(self, theta: float = 0.5, gamma: float = 0.001) -> None:
        self.theta = float(theta)
        self.gamma = float(gamma)
        self.current_theta = 1.0

    def get_state(self) -> dict[str, Any]:
        """The keyword arguments the engine passes to the model's forward."""
        return {"progressive_layer_drop": True, "pld_theta": self.get_theta()}

    def get_theta(self) -> float:
        """The current keep ratio."""
        return self.current_theta

    def update_state(self, global_step: int) -> None:
        """Set the keep ratio for ``global_step`` optimizer steps taken."""
        self.current_theta = (1.0 - self.theta) * math.exp(-self.gamma * global_step) + self.theta

    def state_dict(self) -> dict[str, float]:
        """The schedule's state, for checkpoints."""
        return {"theta": self.theta, "gamma": self.gamma, "current_theta": self.current_theta}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` (the configured theta and gamma are kept)."""
        self.current_theta = float(state["current_theta"])
