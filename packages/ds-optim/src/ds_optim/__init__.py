"""Optimizers, LR schedules, loss scaling and gradient clipping."""

from __future__ import annotations

# --- optimizers: adam (FusedAdam, CPUAdam) ---
# --- optimizers: lamb, lion, adagrad, registry ---
# --- optimizers: communication-efficient (1-bit) ---
# --- LR schedules ---
# --- mixed precision: loss scaling, grad norm, clipping ---

__version__ = "0.1.0"

__all__ = [
    "__version__",
]
