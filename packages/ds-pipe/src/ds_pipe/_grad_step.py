"""The standalone gradient step of a pipeline batch: reduce, norm, non-finite check, clip,
optimizer step.

The pipeline engine drives a :class:`ds_optim.GradientStep`. Under ``ds_engine.initialize()``
that is ds-zero's gradient-step core (the same one the engine drives); :class:`DataParallelStep`
is only the default of a ``PipelineEngine`` built by hand without one (ds-pipe does not depend
on ds-zero), and follows the same non-finite policy.

[Note: the global gradient norm of a pipeline]
Clipping must see the norm of the *whole* model's gradient: every stage's, each element once.
DeepSpeed's pipeline engine computes it from the first stage's gradients only (stage 0 reports
its norm and the other stages clip with their own), so a deep pipeline clips by a norm that
misses most of the model; we fix that. Each rank squares the norm of its own gradients after the
data-parallel reduction, leaving out tied weights whose copy on a lower stage is counted
(``PipelineModule.tied_params_owned_elsewhere()``), and the squares are summed over every rank
of the topology. After the reduction the data-parallel replicas hold identical gradients, so
the sum counts each element ``dp`` times and is divided by ``dp``. The same all-reduce carries
inf/nan, so a non-finite gradient anywhere skips the step on every rank (ds-optim's [Note: one
non-finite policy]: with a loss scaler the scale is lowered, without one a warning is logged).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

import ds_comm
from ds_comm.accelerator import get_accelerator
from ds_optim import GradientStep, StepResult, global_grad_norm

__all__ = ["DataParallelStep", "GradientStep", "StepResult"]

logger = logging.getLogger("ds_pipe")


class DataParallelStep:
    """The standalone :class:`ds_optim.GradientStep`: all-reduce over the data-parallel group,
    then one global norm over every rank (see [Note: the global gradient norm of a pipeline]).
    The pipeline engine sets the boundary around ``step()``; backward passes accumulate.

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
        self.gradient_accumulation_steps = micro_batches
        self.last_result: StepResult | None = None
        self.boundary_override: bool | None = None
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
        self,
        loss: torch.Tensor | Sequence[torch.Tensor],
        *,
        retain_graph: bool = False,
        grad_tensors: Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        tensors = [loss] if torch.is_tensor(loss) else list(loss)
        if grad_tensors is None:
            (value,) = tensors
            (value * (self.loss_scale / self.micro_batches)).backward(retain_graph=retain_graph)
        else:
            torch.autograd.backward(tensors, list(grad_tensors), retain_graph=retain_graph)

    def is_gradient_accumulation_boundary(self) -> bool:
        return bool(self.boundary_override)

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        self.boundary_override = is_boundary

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def get_global_grad_norm(self) -> float | None:
        return self.last_result.grad_norm if self.last_result is not None else None

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.optimizer.load_state_dict(state)

    def memory_breakdown(self) -> Any:
        raise NotImplementedError(
            "memory_breakdown() is ds-zero's: build the pipeline through ds_engine.initialize()"
        )

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
            self._reduce(cast(list[torch.Tensor], [p.grad for p in self.params]))  # all set above

    def step(self) -> StepResult:
        self.last_result = self._step()
        return self.last_result

    def _step(self) -> StepResult:
        if not self.boundary_override:
            return StepResult.not_due(self.loss_scale)
        grads = [p.grad for p in self.params if p.grad is not None]
        scale = self.loss_scale
        # the schedule's ReduceGrads (reduce_gradients) gave every parameter a gradient
        counted = cast(
            list[torch.Tensor], [p.grad for p in self.params if id(p) not in self._excluded]
        )
        norm = self._global_norm(counted) / scale
        if not math.isfinite(norm):  # every rank sees the same norm: every rank skips
            if self.loss_scaler is not None:
                self.loss_scaler.update_scale(True)
            else:
                logger.warning(
                    "the global gradient norm is %s: a gradient holds inf/nan, so the optimizer "
                    "step was skipped on every rank (check the loss and the inputs)",
                    norm,
                )
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(
                boundary=True,
                applied=False,
                overflow=True,
                grad_norm=norm,
                loss_scale=self.loss_scale,
            )
        coef = 1.0 / scale
        if self.gradient_clipping > 0:  # torch's and DeepSpeed's rule
            coef *= min(1.0, self.gradient_clipping / (norm + 1e-6))
        if coef != 1.0:
            torch._foreach_mul_(grads, coef)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(False)
        return StepResult(boundary=True, applied=True, grad_norm=norm, loss_scale=self.loss_scale)


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
