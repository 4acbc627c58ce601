"""0/1 Adam (Lu et al. 2022): variance updated at exponentially sparser steps, 1-bit gradient
averaging in between, then local steps whose accumulated model change is averaged with 1 bit.

[Note: 0/1 Adam]
Two phases, switched by ``var_freeze_step`` (the last step allowed to update the variance):

1. Variance phase, steps ``1..var_freeze_step``. On the steps of the variance schedule the local
   gradients are averaged with a full allreduce and both moments are updated; the schedule starts
   at every step and doubles its interval after every ``var_update_scaler`` updates (1, 1, ...,
   2, 2, ..., 4, ...). On the other steps the gradients are averaged with the 1-bit compressed
   allreduce and only the momentum is updated. Every step applies an Adam update.
2. Local-step phase, later steps. The variance is frozen; each rank updates its momentum with its
   local gradient and steps its own parameters, communicating nothing. Every
   ``local_step_interval`` steps the ranks synchronise: the model change since the last
   synchronisation, times ``sqrt(v_hat) + eps`` (so it is in momentum units,
   ``-sum_i step_size_i m_i``), is averaged with the 1-bit allreduce; the parameters become the
   last synchronised parameters plus the averaged change divided back, and the momentum becomes
   the step-size-weighted average momentum (``-change / sum_i step_size_i``). The interval starts
   at 1 and doubles after every ``local_step_scaler`` steps, up to ``local_step_clipper``.

Where DeepSpeed accumulates the updates in a buffer and undoes them with ``p -= buffer`` (which
leaves each rank with different rounding), this keeps the synchronised parameters themselves
(``sync_anchor``, the same memory) and measures the change as ``p - anchor``: after every
synchronisation the parameters are bit-identical on all ranks. The compression errors restart at
zero when the local-step phase begins (they switch from gradients to model changes), as in
DeepSpeed. ``bias_correction`` is honoured as in :class:`OneBitAdam` (DeepSpeed ignores it); the
variance is corrected by the number of variance updates it received, and the momentum average
weights each step by ``lr / (1 - beta1^t)``. Weight decay is decoupled and, as in DeepSpeed, part
of the model change that the local-step phase averages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ds_optim._onebit_common import (
    FlatGroup,
    OneBitOptimizer,
    adam_denominator,
    check_int,
    moment_correction,
)

__all__ = ["ZeroOneAdam"]


class ZeroOneAdam(OneBitOptimizer):
    """0/1 Adam: Adam with an exponentially sparser variance schedule and 1-bit communication,
    then local steps with 1-bit synchronisation. See [Note: 0/1 Adam].

    Give it each rank's local gradients: it averages them itself (``reduces_gradients``).
    Arguments shared with :class:`OneBitAdam` mean the same; the schedule knobs are DeepSpeed's:

    Args:
        var_freeze_step: the last step that may update the variance (often the end of the LR
            warmup).
        var_update_scaler: variance updates per interval before the interval doubles (kappa).
        local_step_scaler: steps per local-step interval before the interval doubles
            (DeepSpeed's default is 32678).
        local_step_clipper: the largest local-step interval (H).

    Example:
        >>> opt = ZeroOneAdam(model.parameters(), lr=1e-3, var_freeze_step=1000,
        ...                   local_step_scaler=1000, group=dp_group)
        >>> loss_fn(model(x), y).backward()  # no gradient allreduce here
        >>> opt.step()
    """

    _LAZY_BUFFERS: ClassVar[tuple[str, ...]] = ("sync_anchor",)
    _COUNTERS: ClassVar[Mapping[str, float]] = {
        "step": 0,
        "var_interval": 1,
        "var_counter": 0,
        "var_updates": 0,
        "local_step_interval": 1,
        "local_step_counter": 0,
        "lrs": 0.0,
    }

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        group: dist.ProcessGroup | None = None,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ) -> None:
        owner = "ZeroOneAdam"
        for key, value, meaning in (
            ("var_freeze_step", var_freeze_step, "the last step that updates the variance"),
            ("var_update_scaler", var_update_scaler, "updates before the interval doubles"),
            ("local_step_scaler", local_step_scaler, "steps before the local interval doubles"),
            ("local_step_clipper", local_step_clipper, "the largest local-step interval"),
        ):
            check_int(owner, key, value, low=1, meaning=meaning)
        super().__init__(locals())
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper

    def _step_group(self, flat: FlatGroup, group: dict[str, Any]) -> None:
        step = flat.counters["step"] = int(flat.counters["step"]) + 1
        if step <= self.var_freeze_step:
            self._variance_phase_step(flat, group, step)
        else:
            self._local_phase_step(flat, group, step)

    def _denominator(self, flat: FlatGroup, group: dict[str, Any]) -> torch.Tensor:
        correction = moment_correction(group, group["betas"][1], int(flat.counters["var_updates"]))
        return adam_denominator(
            flat.buffers["exp_avg_sq"], correction, group["eps"], self.eps_inside_sqrt
        )

    def _variance_phase_step(self, flat: FlatGroup, group: dict[str, Any], step: int) -> None:
        counters = flat.counters
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = flat.buffers["exp_avg"], flat.buffers["exp_avg_sq"]
        grad = flat.gather_grads()
        if step % counters["var_interval"] == 0:
            self._average(grad)
            self._clip_(grad, group)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            counters["var_updates"] += 1
            counters["var_counter"] += 1
            if counters["var_counter"] == self.var_update_scaler:
                counters["var_counter"] = 0
                counters["var_interval"] *= 2
        else:
            self._clip_(grad, group)
            self._compressed_average(flat, grad)
            self._mask_(grad, group)
            exp_avg.lerp_(grad, 1 - beta1)
        del grad
        step_size = group["lr"] / moment_correction(group, beta1, step)
        self._decay_and_add(flat, group, exp_avg.div(self._denominator(flat, group)), step_size)

    def _local_phase_step(self, flat: FlatGroup, group: dict[str, Any], step: int) -> None:
        counters = flat.counters
        exp_avg = flat.buffers["exp_avg"]
        if "sync_anchor" not in flat.buffers:  # the first step of the phase
            flat.buffer("sync_anchor").copy_(flat.gather_params())
            if flat.comm is not None:
                flat.comm.reset()  # the errors were of gradients; model changes come next
        grad = flat.gather_grads()
        self._clip_(grad, group)
        exp_avg.lerp_(grad, 1 - group["betas"][0])
        del grad
        step_size = group["lr"] / moment_correction(group, group["betas"][0], step)
        counters["lrs"] += step_size
        denom = self._denominator(flat, group)
        self._decay_and_add(flat, group, exp_avg.div(denom), step_size)
        if step % counters["local_step_interval"] == 0:
            self._synchronize(flat, group, denom)
        counters["local_step_counter"] += 1
        if counters["local_step_counter"] == self.local_step_scaler:
            counters["local_step_counter"] = 0
            counters["local_step_interval"] = min(
                self.local_step_clipper, counters["local_step_interval"] * 2
            )

    def _synchronize(self, flat: FlatGroup, group: dict[str, Any], denom: torch.Tensor) -> None:
        anchor = flat.buffers["sync_anchor"]
        change = flat.gather_params().sub_(anchor).mul_(denom)  # -sum_i step_size_i m_i
        self._compressed_average(flat, change)
        self._mask_(change, group)
        if flat.counters["lrs"] > 0:
            flat.buffers["exp_avg"].copy_(change).div_(-flat.counters["lrs"])
        anchor.add_(change.div_(denom))
        flat.copy_to_params(anchor)
        flat.counters["lrs"] = 0.0
