"""``SelfReducingStep``: the step for optimizers that average their own gradients.

[Note: optimizers that reduce their own gradients]
ds-optim's 1-bit optimizers (``reduces_gradients = True``) take each rank's *local* gradients
and run a compressed all-reduce with error feedback inside ``step()``; reducing the gradients
before them would average twice and defeat the compression. For them the engine skips ds-zero
(stage 0 only, as in DeepSpeed) and runs this: scaled backward with local accumulation, then the
optimizer's own step. Clipping is the optimizer's ``max_grad_norm``: only it sees the averaged
gradient. With fp16 the loss scale is divided out of the gradients before the step; an overflow
seen on any rank (checked over the group) skips the step on all of them.
"""

from __future__ import annotations

from typing import Any

import torch

import ds_comm
from ds_optim import has_overflow

__all__ = ["SelfReducingStep"]


class SelfReducingStep:
    """Backward/step for a ``reduces_gradients`` optimizer (see [Note: optimizers that reduce
    their own gradients]); the subset of ``ZeroOptimizer``'s interface the engine uses."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        group: Any,
        loss_scaler: Any,
        gradient_accumulation_steps: int,
    ) -> None:
        self.module, self.optimizer, self.group = model, optimizer, group
        self.loss_scaler = loss_scaler
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.global_steps = self.skipped_steps = self.micro_steps = 0
        self._window = 0
        self._boundary: bool | None = None
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        if ds_comm.is_initialized() and ds_comm.get_world_size(group) > 1:
            for p in model.parameters():  # identical starting weights, as ds-zero does
                ds_comm.broadcast(p.data, 0, group=group)

    @property
    def loss_scale(self) -> float:
        return float(self.loss_scaler.loss_scale) if self.loss_scaler is not None else 1.0

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary is not None:
            return self._boundary
        return self._window + 1 >= self.gradient_accumulation_steps

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        self._boundary = is_boundary

    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False) -> None:
        scale = self.loss_scale / self.gradient_accumulation_steps
        (loss * scale).backward(retain_graph=retain_graph)
        self.micro_steps += 1
        self._window += 1

    def step(self) -> bool:
        due = self._window >= self.gradient_accumulation_steps
        if not (self._boundary if self._boundary is not None else due):
            return False
        self._window = 0
        grads = [p.grad for p in self._params if p.grad is not None]
        if self.loss_scaler is not None and self.loss_scale != 1.0:
            group = self.group if ds_comm.is_initialized() else None
            if has_overflow(grads, group=group):
                self.loss_scaler.update_scale(True)
                self.skipped_steps += 1
                self.zero_grad()
                return True
            torch._foreach_mul_(grads, 1.0 / self.loss_scale)
        self.optimizer.step()
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(False)
        self.zero_grad()
        self.global_steps += 1
        return False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def get_global_grad_norm(self) -> float | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            "counters": [self.micro_steps, self.global_steps, self.skipped_steps],
        }

    def load_state_dict(self, state: Any) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.loss_scaler is not None and state["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        self.micro_steps, self.global_steps, self.skipped_steps = state["counters"]
