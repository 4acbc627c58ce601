"""``SelfReducingStep``: the gradient-step core for optimizers that average their own gradients.

[Note: optimizers that reduce their own gradients]
ds-optim's 1-bit optimizers (``reduces_gradients = True``) take each rank's *local* gradients and
run a compressed all-reduce with error feedback inside ``step()``; reducing the gradients before
them would average twice and defeat the compression. For them the engine runs the core
(``_core.py``) with this layout (``_LocalLayout``) and whole parameters, at stage 0 only (as
DeepSpeed): no reduction, gradients kept where autograd puts them (``p.grad``), the optimizer's own
step. The norm is that of every rank's local gradients together (one scalar all-reduce), so a
non-finite gradient on any rank skips the step on all of them (ds-optim's [Note: one non-finite
policy]). Clipping is the optimizer's ``max_grad_norm``: only it sees the averaged gradient.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

import ds_comm
from ds_optim import global_grad_norm
from ds_zero._core import GradientCore
from ds_zero._residency import WholeResidency
from ds_zero.api import MemoryBreakdown

__all__ = ["SelfReducingStep"]


class _LocalGrads:
    """The reducer interface over gradients left where autograd puts them (``p.grad``)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def begin(self, reduce: bool) -> None:
        """Nothing to arm: the optimizer reduces in its step."""

    def finish(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def zero(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


class _LocalLayout:
    """The layout of local gradients: the optimizer's own parameters and step."""

    def __init__(self, optimizer: torch.optim.Optimizer, group: Any, distributed: bool) -> None:
        self.optimizer, self.group, self._distributed = optimizer, group, distributed
        self.reducer = _LocalGrads(optimizer)
        self._params = [p for g in optimizer.param_groups for p in g["params"]]

    def master_grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self._params if p.grad is not None]

    def global_norm(self, grads: Sequence[torch.Tensor]) -> float:
        device = grads[0].device if grads else torch.device("cpu")
        local = global_grad_norm(grads) if grads else torch.zeros((), device=device)
        square = local.double().square().reshape(1)
        if self._distributed:
            ds_comm.all_reduce(square, group=self.group)
        value = float(square.item())
        return math.sqrt(value) if math.isfinite(value) else value

    def apply(self, grads: Sequence[torch.Tensor]) -> None:
        del grads  # the optimizer reduces and applies the parameters' own gradients
        self.optimizer.step()


class SelfReducingStep(GradientCore):
    """The core over a ``reduces_gradients`` optimizer (see [Note: optimizers that reduce their
    own gradients]).

    Args:
        model: the module (its parameters are broadcast from the group's first rank).
        optimizer: the 1-bit optimizer.
        group: the data-parallel group its step reduces over (None: the default group).
        loss_scaler: ds-optim's loss scaler for fp16 (None: no scaling).
        gradient_accumulation_steps: micro-batches per optimizer step.

    Example:
        >>> step = SelfReducingStep(model, ds_optim.OneBitAdam(model.parameters()), group=None,
        ...                         loss_scaler=None, gradient_accumulation_steps=1)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        group: Any,
        loss_scaler: Any,
        gradient_accumulation_steps: int,
    ) -> None:
        self.module, self.group = model, group
        distributed = ds_comm.is_initialized() and ds_comm.get_world_size(group) > 1
        if distributed:
            for p in model.parameters():  # identical starting weights, as ds-zero does
                ds_comm.broadcast(p.data, 0, group=group)
        super().__init__(
            _LocalLayout(optimizer, group, distributed),
            WholeResidency(),
            optimizer=optimizer,
            loss_scaler=loss_scaler,
            gradient_accumulation_steps=gradient_accumulation_steps,
            gradient_clipping=0.0,  # the optimizer's max_grad_norm (see the note)
        )

    # --- the rest of the engine's interface -----------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the accumulated gradients."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def memory_breakdown(self) -> MemoryBreakdown:
        """Bytes this rank holds: the whole model, its gradients and the optimizer's state."""
        params = sum(p.nbytes for p in self.module.parameters())
        state = self.optimizer.state.values()
        states = sum(v.nbytes for s in state for v in s.values() if torch.is_tensor(v))
        grads = sum(p.grad.nbytes for p in self.module.parameters() if p.grad is not None)
        return MemoryBreakdown(params=params, grads=grads, optimizer_state=states)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's and the loss scaler's state, and the counters."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
            "counters": [self.micro_steps, self.global_steps, self.skipped_steps],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""
        self.optimizer.load_state_dict(state["optimizer"])
        if self.loss_scaler is not None and state["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        self.micro_steps, self.global_steps, self.skipped_steps = state["counters"]
