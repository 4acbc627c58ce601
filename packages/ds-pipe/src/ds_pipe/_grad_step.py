"""The gradient step of a pipeline batch: reduce, norm, clip, overflow check, optimizer step.

[Note: the global gradient norm of a pipeline]
Clipping must see the norm of the *whole* model's gradient: every stage's, each element once.
DeepSpeed's pipeline engine computes it from the first stage's gradients only (stage 0 reports
its norm and the other stages clip with their own), so a deep pipeline clips by a norm that
misses most of the model; we fix that. Each rank squares the norm of its own gradients after the
data-parallel reduction, leaving out tied weights whose copy on a lower stage is counted
(``PipelineModule.tied_params_owned_elsewhere()``), and the squares are summed over every rank
of the topology. After the reduction the data-parallel replicas hold identical gradients, so
the sum counts each element ``dp`` times and is divided by ``dp``. The same all-reduce carries
inf/nan, so an fp16 overflow anywhere skips the step on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

import ds_comm
from ds_comm.accelerator import get_accelerator
from ds_optim import global_grad_norm

__all__ = ["DataParallelStep", "GradientStep", "StepResult"]


@dataclass(frozen=True)
class StepResult:
    """What one gradient step did.

    Attributes:
        skipped: True when an inf/nan gradient (fp16 overflow) skipped the optimizer step.
        grad_norm: the global L2 norm of the unscaled gradients before clipping; None when
            neither clipping nor a loss scaler needed it (one all-reduce saved, as DeepSpeed).
    """

    skipped: bool
    grad_norm: float | None


@runtime_checkable
class GradientStep(Protocol):
    """What the pipeline engine asks of a gradient step; ds-engine passes a ZeRO stage-1 one.

    ``backward`` runs once per micro-batch on each chunk; ``reduce_gradients`` and ``step`` once
    per batch, after the schedule's last backward and the tied-gradient reduction.
    """

    optimizer: torch.optim.Optimizer

    @property
    def loss_scale(self) -> float:
        """The current fp16 loss scale (1.0 without one)."""
        ...

    def backward(
        self, tensors: Sequence[torch.Tensor], grad_tensors: Sequence[torch.Tensor] | None = None
    ) -> None:
        """Backpropagate: ``tensors`` is ``[loss]`` (unscaled; the step scales it by the loss
        scale over the micro-batches) with ``grad_tensors`` None, or a stage's outputs with
        the gradients received for them (already scaled)."""
        ...

    def reduce_gradients(self) -> None:
        """Reduce the batch's gradients over the data-parallel replicas (may be deferred to
        :meth:`step`)."""
        ...

    def step(self) -> StepResult:
        """Take the global norm, clip, check overflow, step the optimizer and clear the
        gradients."""
        ...


class DataParallelStep:
    """The default :class:`GradientStep`: all-reduce over the data-parallel group, then one
    global norm over every rank (see [Note: the global gradient norm of a pipeline]).

    Args:
        params: the parameters this rank trains (the stage's).
        optimizer: the torch optimizer over them.
        micro_batches: micro-batches per batch; the loss is divided by it.
        data_group: the data-parallel process group (None or size 1: no reduction).
        norm_group: the group covering every rank of the topology, for the norm and overflow.
        norm_exclude: parameters whose gradients another rank counts in the norm.
        gradient_clipping: clip the global norm to this (0: no clipping).
        loss_scaler: a ds-optim loss scaler for fp16 (None: no scaling).

    Example:
        >>> step = DataParallelStep(module.parameters(), opt, micro_batches=8,
        ...                         data_group=grid.get_group("data"), norm_group=None)
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer,
        *,
        micro_batches: int,
        data_group: Any = None,
        norm_group: Any = None,
        norm_exclude: Iterable[torch.Tensor] = (),
        gradient_clipping: float = 0.0,
        loss_scaler: Any = None,
    ) -> None:
        if gradient_clipping < 0 or not math.isfinite(gradient_clipping):
            raise ValueError(f"gradient_clipping = {gradient_clipping!r}: expected a number >= 0")
        self.params = [p for p in params if p.requires_grad]
        self.optimizer = optimizer
        self.micro_batches = micro_batches
        self.data_group = data_group
        self.norm_group = norm_group
        self._excluded = {id(p) for p in norm_exclude}
        self.gradient_clipping = float(gradient_clipping)
        self.loss_scaler = loss_scaler
        self.dp_world_size = _size(data_group)
        if self.dp_world_size > 1:  # replicas start from identical weights, as ds-zero does
            src = _first_rank(data_group)
            with torch.no_grad():
                for p in self.params:
                    ds_comm.broadcast(p.data, src, group=data_group)

    @property
    def loss_scale(self) -> float:
        return float(self.loss_scaler.loss_scale) if self.loss_scaler is not None else 1.0

    def backward(
        self, tensors: Sequence[torch.Tensor], grad_tensors: Sequence[torch.Tensor] | None = None
    ) -> None:
        if grad_tensors is None:
            (loss,) = tensors
            (loss * (self.loss_scale / self.micro_batches)).backward()
        else:
            torch.autograd.backward(list(tensors), grad_tensors=list(grad_tensors))

    def _reduce(self, grads: list[torch.Tensor]) -> None:
        """Average ``grads`` over the data-parallel replicas, one flat buffer per dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for group in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in group])
            ds_comm.all_reduce(flat, group=self.data_group)
            flat.div_(self.dp_world_size)
            offset = 0
            for g in group:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def _global_norm(self, counted: list[torch.Tensor]) -> float:
        """The norm of the scaled gradients over every rank, each element once."""
        # the norm group's device: the stage's, or the accelerator's for a stage without grads
        device = counted[0].device if counted else _device_of(self.params)
        local = global_grad_norm(counted) if counted else torch.zeros((), device=device)
        square = local.double().square().reshape(1)
        if _size(self.norm_group) > 1:
            ds_comm.all_reduce(square, group=self.norm_group)
        return math.sqrt(float(square.item()) / self.dp_world_size)

    def reduce_gradients(self) -> None:
        for p in self.params:
            if p.grad is None:  # every replica must reduce the same tensors
                p.grad = torch.zeros_like(p)
        if self.dp_world_size > 1:
            self._reduce([p.grad for p in self.params])

    def step(self) -> StepResult:
        grads = [p.grad for p in self.params if p.grad is not None]
        scale = self.loss_scale
        if self.gradient_clipping == 0 and self.loss_scaler is None:
            if scale != 1.0:
                torch._foreach_mul_(grads, 1.0 / scale)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(skipped=False, grad_norm=None)
        counted = [p.grad for p in self.params if id(p) not in self._excluded]
        norm = self._global_norm(counted) / scale
        if not math.isfinite(norm):
            if self.loss_scaler is None:
                raise FloatingPointError(
                    f"the global gradient norm is {norm}: a gradient holds inf/nan (check the "
                    "loss and the inputs, or enable fp16 loss scaling to skip such steps)"
                )
            self.loss_scaler.update_scale(True)
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(skipped=True, grad_norm=norm)
        coef = 1.0 / scale
        if self.gradient_clipping > 0:  # torch's and DeepSpeed's rule
            coef *= min(1.0, self.gradient_clipping / (norm + 1e-6))
        if coef != 1.0:
            torch._foreach_mul_(grads, coef)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(False)
        return StepResult(skipped=False, grad_norm=norm)


def _device_of(params: Sequence[torch.Tensor]) -> torch.device:
    if params:
        return params[0].device
    return torch.device(get_accelerator().current_device_name())


def _size(group: Any) -> int:
    if group is None or not ds_comm.is_initialized():
        return 1
    return ds_comm.get_world_size(group)


def _first_rank(group: Any) -> int:
    return min(dist.get_process_group_ranks(group))
