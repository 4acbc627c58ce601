"""Adagrad with DeepSpeed's CPU Adagrad arguments, multi-tensor."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from ds_optim import _multi_tensor as mt

# [Note: Adagrad weight decay]
# DeepSpeed's CPU Adagrad (csrc/adagrad/cpu_adagrad.cpp) adds weight_decay * p to the gradient
# that goes into the squared-gradient sum, but divides the *raw* gradient by sqrt(sum) + eps,
# so weight decay never pulls a weight towards zero; with weight_decay == 0 it is textbook
# Adagrad. We use the textbook L2 form in both places, as torch.optim.Adagrad does:
#   g' = g + weight_decay * p;  sum += g'^2;  p -= lr * g' / (sqrt(sum) + eps)
# which is identical to DeepSpeed without weight decay and to torch.optim.Adagrad always.


class Adagrad(mt.FP32StateOptimizer):
    """Adagrad: per-element step ``lr / (sqrt(sum of squared grads) + eps)``.

    DeepSpeed's ``DeepSpeedCPUAdagrad`` arguments and state name (``exp_avg_sq``, the running sum
    of squared grads), on any device, matching ``torch.optim.Adagrad`` (no ``lr_decay``, zero
    initial accumulator). See [Note: Adagrad weight decay] in the source for how weight decay
    differs from DeepSpeed's CPU kernel. fp16/bf16 params keep an fp32 sum unless
    ``fp32_optimizer_states`` is False.

    Args:
        params: Params or param groups.
        lr: Learning rate.
        eps: Added to ``sqrt(sum)``.
        weight_decay: L2 penalty added to the gradient.
        amsgrad: Not supported (accepted for DeepSpeed's signature); True raises.
        fp32_optimizer_states: keep the sum of fp16/bf16 params in fp32 (DeepSpeed's
            ``DeepSpeedCPUAdagrad`` default); False keeps it in the param's dtype (half the
            memory; the update still runs in fp32).

    Example:
        >>> opt = ds_optim.Adagrad(model.parameters(), lr=1e-2)
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
    ) -> None:
        if amsgrad:
            raise ValueError("Adagrad: amsgrad=True is not supported (it is an Adam variant)")
        defaults = {
            "lr": mt.check_non_negative("Adagrad", "lr", lr),
            "eps": mt.check_non_negative("Adagrad", "eps", eps),
            "weight_decay": mt.check_non_negative("Adagrad", "weight_decay", weight_decay),
        }
        super().__init__(params, defaults)
        self.fp32_optimizer_states = mt.check_flag(
            "Adagrad", "fp32_optimizer_states", fp32_optimizer_states
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Takes one step for every param that has a grad; returns ``closure()`` if given."""
        loss = mt.run_closure(closure)
        for group, _, bucket in mt.iter_buckets(self, self._init_state):
            params, grads, sums = (
                bucket.work_params(),
                bucket.work_grads(),
                bucket.state("exp_avg_sq"),
            )
            if group["weight_decay"] != 0:
                grads = torch._foreach_add(grads, params, alpha=group["weight_decay"])
            torch._foreach_addcmul_(sums, grads, grads, value=1.0)
            denom = torch._foreach_sqrt(sums)
            torch._foreach_add_(denom, group["eps"])
            torch._foreach_addcdiv_(params, grads, denom, value=-group["lr"])
            bucket.count_step()
            bucket.write_back()
        return loss

    def _init_state(self, param: torch.Tensor) -> dict[str, Any]:
        return {"step": 0, "exp_avg_sq": mt.zeros_state(param, self.fp32_optimizer_states)}
