"""1-bit Adam (Tang et al. 2021): full Adam while the variance settles, then frozen variance and
1-bit compressed momentum.

[Note: 1-bit Adam]
Adam's variance ``v`` changes slowly once training is past its first phase, and Adam with a fixed
``v`` is momentum SGD with a per-coordinate step size, whose momentum can be communicated with
1-bit compression and error feedback without hurting convergence. So:

1. Warmup, steps ``1..freeze_step``: the local gradients are averaged with a plain allreduce and a
   full Adam step runs (``m`` and ``v`` both updated).
2. Compression, later steps: ``v`` is frozen. Each rank folds its *local* gradient into its copy
   of ``m`` (``m = beta1 m + (1 - beta1) g``), the momenta are averaged with the 1-bit compressed
   allreduce (``ds_comm.CompressedAllReduce``, one error-feedback state per param group) and the
   identical averaged ``m`` on every rank drives ``p -= lr m_hat / (sqrt(v_hat) + eps)``.

Weight decay is decoupled, as in DeepSpeed (``update += weight_decay * p``, times ``lr``).
``bias_correction`` is honoured: DeepSpeed accepts it but never corrects, which makes early
steps ``~1/sqrt(1 - beta2^t)`` larger and freezes an under-estimated ``v`` when ``freeze_step``
is short; ``bias_correction=False`` reproduces DeepSpeed's updates. After the freeze ``v_hat``
keeps the correction of step ``freeze_step``. DeepSpeed's first ``step()`` only warms up its
communication buffers and updates nothing; here every step is a real step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from ds_optim._onebit_common import (
    FlatGroup,
    OneBitOptimizer,
    adam_denominator,
    check_int,
    moment_correction,
)

__all__ = ["OneBitAdam"]


class OneBitAdam(OneBitOptimizer):
    """1-bit Adam: Adam for ``freeze_step`` steps, then frozen variance and the momentum averaged
    with 1-bit compression (~1/32 of the allreduce bytes). See [Note: 1-bit Adam].

    Give it each rank's local gradients: it averages them itself (``reduces_gradients``).

    Args:
        params: parameters or param groups (a group may carry ``exp_avg_mask``, a 0/1 tensor with
            one entry per element of its parameters, for momenta that are always exactly zero).
        group: process group to average over (``None``: the default group; no process group at
            all means a single process). Replaces DeepSpeed's ``deepspeed`` engine argument.
        lr: learning rate.
        freeze_step: number of full-precision Adam steps before compression starts.
        bias_correction: divide the moments by ``1 - beta**t`` (see the note on DeepSpeed).
        betas: coefficients of the running averages of the gradient and its square.
        eps: added to the denominator for numerical stability.
        eps_inside_sqrt: use ``sqrt(v_hat + eps)`` instead of ``sqrt(v_hat) + eps``.
        weight_decay: decoupled weight decay (AdamW style).
        max_grad_norm: if > 0, clip each group's gradient to this L2 norm before it enters the
            momentum (the averaged gradient in warmup, the local one after; DeepSpeed ignores it).
        amsgrad: must be False.
        cuda_aware: accepted for config compatibility (an MPI setting); no effect.
        comm_backend_name: accepted for config compatibility; the backend is ``group``'s.

    Example:
        >>> opt = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=1000, group=dp_group)
        >>> loss_fn(model(x), y).backward()  # no gradient allreduce here
        >>> opt.step()
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        group: dist.ProcessGroup | None = None,
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ) -> None:
        meaning = "full Adam steps before compression starts; the frozen variance needs one"
        check_int("OneBitAdam", "freeze_step", freeze_step, low=1, meaning=meaning)
        super().__init__(locals())
        self.freeze_step = freeze_step

    def _step_group(self, flat: FlatGroup, group: dict[str, Any]) -> None:
        step = flat.counters["step"] = int(flat.counters["step"]) + 1
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = flat.buffers["exp_avg"], flat.buffers["exp_avg_sq"]
        grad = flat.gather_grads()
        if step <= self.freeze_step:
            self._average(grad)
            self._clip_(grad, group)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            variance_steps = step
        else:
            self._clip_(grad, group)
            exp_avg.lerp_(grad, 1 - beta1)
            self._compressed_average(flat, exp_avg)
            self._mask_(exp_avg, group)
            variance_steps = self.freeze_step
        del grad
        denom = adam_denominator(
            exp_avg_sq,
            moment_correction(group, beta2, variance_steps),
            group["eps"],
            self.eps_inside_sqrt,
        )
        step_size = group["lr"] / moment_correction(group, beta1, step)
        self._decay_and_add(flat, group, exp_avg.div(denom), step_size)
