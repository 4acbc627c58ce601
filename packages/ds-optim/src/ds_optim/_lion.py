"""Lion (EvoLved Sign Momentum, Chen et al. 2023), multi-tensor."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ds_optim import _multi_tensor as mt


class Lion(mt.FP32StateOptimizer):
    """Lion: a sign update of an interpolated momentum, with decoupled weight decay.

    Per element, as in the paper (Algorithm 2)::

        c = beta1 * m + (1 - beta1) * g
        p = p * (1 - lr * weight_decay) - lr * sign(c)
        m = beta2 * m + (1 - beta2) * g

    The update has magnitude ``lr`` in every coordinate, so Lion's learning rate is usually 3-10x
    smaller than AdamW's and its weight decay 3-10x larger. ``betas`` default to DeepSpeed's
    ``FusedLion`` value ``(0.9, 0.999)``, so a DeepSpeed config without ``betas`` trains the same;
    the paper recommends ``(0.9, 0.99)``. fp16/bf16 params
    keep an fp32 ``exp_avg`` unless ``fp32_optimizer_states`` is False.

    Args:
        params: Params or param groups.
        lr: Learning rate.
        betas: Interpolation factor of the update (``beta1``) and momentum decay (``beta2``).
        weight_decay: Decoupled weight decay factor.
        set_grad_none: ``zero_grad()`` sets grads to None (else zeroes them).
        fp32_optimizer_states: keep ``exp_avg`` of fp16/bf16 params in fp32 (DeepSpeed's
            ``DeepSpeedCPULion`` default); False keeps it in the param's dtype (half the memory;
            the update still runs in fp32).

    Example:
        >>> opt = ds_optim.Lion(model.parameters(), lr=1e-4, weight_decay=0.1)
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
        fp32_optimizer_states: bool = True,
    ) -> None:
        defaults = {
            "lr": mt.check_non_negative("Lion", "lr", lr),
            "betas": mt.check_betas("Lion", betas),
            "weight_decay": mt.check_non_negative("Lion", "weight_decay", weight_decay),
        }
        super().__init__(params, defaults)
        self.set_grad_none = set_grad_none
        self.fp32_optimizer_states = mt.check_flag(
            "Lion", "fp32_optimizer_states", fp32_optimizer_states
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Takes one step for every param that has a grad; returns ``closure()`` if given."""
        loss = mt.run_closure(closure)
        for group, _, bucket in mt.iter_buckets(self, self._init_state):
            beta1, beta2 = group["betas"]
            lr, weight_decay = group["lr"], group["weight_decay"]
            params, grads, exp_avgs = (
                bucket.work_params(),
                bucket.work_grads(),
                bucket.state("exp_avg"),
            )
            direction = torch._foreach_lerp(exp_avgs, grads, 1.0 - beta1)
            torch._foreach_sign_(direction)
            if weight_decay != 0:
                torch._foreach_mul_(params, 1.0 - lr * weight_decay)
            torch._foreach_add_(params, direction, alpha=-lr)
            torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta2)
            bucket.count_step()
            bucket.write_back()
        return loss

    def _init_state(self, param: torch.Tensor) -> dict[str, Any]:
        return {"step": 0, "exp_avg": mt.zeros_state(param, self.fp32_optimizer_states)}
