"""FusedAdam: Adam/AdamW over all of a param group's tensors at once (DeepSpeed's signature)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

import ds_kernels
from ds_kernels import Backend
from ds_optim import _multi_tensor as mt


class FusedAdam(mt.FP32StateOptimizer):
    """Adam and AdamW, multi-tensor: ``torch._foreach_*`` ops on CPU, one Triton launch on CUDA.

    Drop-in for DeepSpeed's ``FusedAdam``; matches ``torch.optim.AdamW`` (``adam_w_mode=True``,
    the default) or ``torch.optim.Adam`` (``adam_w_mode=False``, weight decay as an L2 term
    added to the gradient). The update is :func:`ds_kernels.adam`, applied per bucket of params
    sharing a device, a dtype and a step count. fp16/bf16 params keep fp32 ``exp_avg`` and
    ``exp_avg_sq`` and are updated in fp32, rounded once per step.

    Args:
        params: Params or param groups.
        lr: Learning rate.
        bias_correction: Divide the moments by ``1 - beta**step``.
        betas: Decay rates of the first and second moments.
        eps: Added to the bias-corrected ``sqrt(exp_avg_sq)``.
        adam_w_mode: Decoupled weight decay (AdamW) when True, L2 regularisation when False.
        weight_decay: Weight decay factor.
        amsgrad: Not supported; True raises.
        set_grad_none: ``zero_grad()`` sets grads to None (else zeroes them).
        backend: Force ``"triton"`` or ``"torch"`` for the update (see :func:`ds_kernels.adam`);
            None picks Triton for CUDA tensors.

    Raises:
        ValueError: ``amsgrad=True`` or an out-of-range hyperparameter.

    Example:
        >>> opt = ds_optim.FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        *,
        backend: Backend | None = None,
    ) -> None:
        if amsgrad:
            raise ValueError(
                "FusedAdam: amsgrad=True is not supported (the AMSGrad variant); use "
                "torch.optim.Adam(amsgrad=True), or the optimizer config "
                '{"type": "Adam", "params": {"torch_adam": true, "amsgrad": true}}'
            )
        defaults = {
            "lr": mt.check_non_negative("FusedAdam", "lr", lr),
            "bias_correction": bool(bias_correction),
            "betas": mt.check_betas("FusedAdam", betas),
            "eps": mt.check_non_negative("FusedAdam", "eps", eps),
            "weight_decay": mt.check_non_negative("FusedAdam", "weight_decay", weight_decay),
            "adam_w_mode": bool(adam_w_mode),
        }
        super().__init__(params, defaults)
        self.set_grad_none = set_grad_none
        self.backend: Backend | None = backend

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Takes one step for every param that has a grad; returns ``closure()`` if given."""
        loss = mt.run_closure(closure)
        for group, key, bucket in mt.iter_buckets(self, _init_state, _step_after_increment):
            beta1, beta2 = group["betas"]
            ds_kernels.adam(
                bucket.params,
                bucket.grads,
                bucket.state("exp_avg"),
                bucket.state("exp_avg_sq"),
                step=key[-1],  # type: ignore[index]
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                adam_w_mode=group["adam_w_mode"],
                bias_correction=group["bias_correction"],
                backend=self.backend,
            )
        return loss


def _init_state(param: torch.Tensor) -> dict[str, Any]:
    return {"step": 0, "exp_avg": mt.zeros_state(param), "exp_avg_sq": mt.zeros_state(param)}


def _step_after_increment(state: dict[str, Any]) -> int:
    # Each param counts its own steps (a param without a grad in a step does not advance), and
    # params are bucketed by that count so that each bucket has one bias correction.
    state["step"] += 1
    return state["step"]
