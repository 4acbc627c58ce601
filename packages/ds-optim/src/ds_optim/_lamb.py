"""FusedLamb (and its alias Lamb): LAMB with DeepSpeed's per-tensor trust ratio semantics."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ds_optim import _multi_tensor as mt

# [Note: LAMB trust ratio, DeepSpeed's way]
# DeepSpeed's FusedLamb (csrc/lamb/fused_lamb_cuda_kernel.cu) updates each tensor as
#   g = grad / combined_scale
#   m = b1*m + (1-b1)*g                 v = b2*v + (1-b2)*g*g
#   update = m / (sqrt(v) + eps) + weight_decay * p      (eps_inside_sqrt: m / sqrt(v + eps))
#   coeff = clamp(||p|| / ||update||, min_coeff, max_coeff), or 1 when either norm is 0
#   p -= step_size * coeff * update,    step_size = lr * sqrt(1 - b2**t) / (1 - b1**t)
# so the moments inside `update` are NOT bias corrected (the correction is folded into
# step_size), eps is added to the raw sqrt(v), and weight decay enters the update (and so the
# trust ratio) before the ratio is taken. The norms are per tensor, in fp32. With max_grad_norm
# > 0 the grads are also divided by clip = (||grads of the group|| / scale + 1e-6) /
# max_grad_norm when clip > 1: combined_scale = scale * max(clip, 1). We follow all of this so
# that DeepSpeed checkpoints and hyperparameters carry over.


class FusedLamb(mt.FP32StateOptimizer):
    """LAMB (layer-wise adaptive moments) with DeepSpeed's semantics, multi-tensor.

    Each tensor's Adam-style update is scaled by its trust ratio ``||p|| / ||update||``,
    clamped to ``[min_coeff, max_coeff]`` (1 when either norm is 0); see
    [Note: LAMB trust ratio, DeepSpeed's way] in the source for the exact formula. Runs on any
    device with ``torch._foreach_*`` ops; fp16/bf16 params keep fp32 state.

    Args:
        params: Params or param groups.
        lr: Learning rate.
        bias_correction: Fold ``sqrt(1 - b2**t) / (1 - b1**t)`` into the step size.
        betas: Decay rates of the first and second moments.
        eps: Added to ``sqrt(exp_avg_sq)`` (or inside the sqrt with ``eps_inside_sqrt``).
        eps_inside_sqrt: Use ``sqrt(exp_avg_sq + eps)`` as the denominator.
        weight_decay: Added to the update as ``weight_decay * p`` before the trust ratio.
        max_grad_norm: When > 0, divide a group's grads by their norm over this when it is larger.
        max_coeff: Upper clamp of the trust ratio.
        min_coeff: Lower clamp of the trust ratio.
        amsgrad: Not supported; True raises.

    Raises:
        ValueError: ``amsgrad=True``, ``min_coeff > max_coeff`` or an out-of-range value.

    Example:
        >>> opt = ds_optim.FusedLamb(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> loss.backward(); opt.step(); opt.get_lamb_coeffs()
        [0.83, 1.0, ...]
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
    ) -> None:
        if amsgrad:
            raise ValueError("FusedLamb: amsgrad=True is not supported (the AMSGrad variant)")
        name = type(self).__name__
        defaults = {
            "lr": mt.check_non_negative(name, "lr", lr),
            "bias_correction": bool(bias_correction),
            "betas": mt.check_betas(name, betas),
            "eps": mt.check_non_negative(name, "eps", eps),
            "weight_decay": mt.check_non_negative(name, "weight_decay", weight_decay),
            "max_grad_norm": mt.check_non_negative(name, "max_grad_norm", max_grad_norm),
            "max_coeff": mt.check_non_negative(name, "max_coeff", max_coeff),
            "min_coeff": mt.check_non_negative(name, "min_coeff", min_coeff),
        }
        if defaults["min_coeff"] > defaults["max_coeff"]:
            raise ValueError(
                f"{name}: min_coeff must be <= max_coeff, got min_coeff={min_coeff} and "
                f"max_coeff={max_coeff}"
            )
        super().__init__(params, defaults)
        self.eps_inside_sqrt = bool(eps_inside_sqrt)
        self.lamb_coeffs: list[torch.Tensor] = []

    @torch.no_grad()
    def step(  # type: ignore[override]
        self,
        closure: Callable[[], Any] | None = None,
        *,
        scale: float = 1.0,
        grad_norms: Sequence[float | torch.Tensor] | None = None,
    ) -> Any:
        """Takes one step for every param that has a grad; returns ``closure()`` if given.

        Args:
            closure: Re-evaluates the model and returns the loss.
            scale: The grads are divided by this (an fp16 loss scale), as in DeepSpeed.
            grad_norms: Per param group, the norm of its (scaled) grads for ``max_grad_norm``;
                computed from the grads when omitted.
        """
        loss = mt.run_closure(closure)
        self.lamb_coeffs = []
        for index, group in enumerate(self.param_groups):
            buckets = mt.bucket_group(self, group, _init_state).values()
            if not buckets:
                continue
            norm = None if grad_norms is None else grad_norms[index]
            combined_scale = _combined_scale(group, buckets, scale, norm)
            for bucket in buckets:
                self.lamb_coeffs.extend(self._update(group, bucket, combined_scale))
        return loss

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratios of the last step, one per updated param (by group, device, dtype)."""
        return [float(c) for c in self.lamb_coeffs]

    def _update(
        self, group: dict[str, Any], bucket: mt.TensorBucket, combined_scale: float
    ) -> list[torch.Tensor]:
        beta1, beta2 = group["betas"]
        params, grads = bucket.work_params(), bucket.work_grads()
        exp_avgs, exp_avg_sqs = bucket.state("exp_avg"), bucket.state("exp_avg_sq")
        if combined_scale != 1.0:
            grads = torch._foreach_div(grads, combined_scale)
        torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
        if self.eps_inside_sqrt:
            denom = torch._foreach_sqrt(torch._foreach_add(exp_avg_sqs, group["eps"]))
        else:
            denom = torch._foreach_add(torch._foreach_sqrt(exp_avg_sqs), group["eps"])
        updates = torch._foreach_div(exp_avgs, denom)
        if group["weight_decay"] != 0:
            torch._foreach_add_(updates, params, alpha=group["weight_decay"])
        coeffs = _trust_ratios(params, updates, group["min_coeff"], group["max_coeff"])
        step_sizes = [-_step_size(group, step) for step in bucket.count_step()]
        scales = coeffs * torch.tensor(step_sizes, device=coeffs.device)
        torch._foreach_mul_(updates, list(scales.unbind()))
        torch._foreach_add_(params, updates)
        bucket.write_back()
        return list(coeffs.unbind())


Lamb = FusedLamb
"""The registry's ``"Lamb"`` type: the same optimizer as :class:`FusedLamb` (as in DeepSpeed)."""


def _init_state(param: torch.Tensor) -> dict[str, Any]:
    return {"step": 0, "exp_avg": mt.zeros_state(param), "exp_avg_sq": mt.zeros_state(param)}


def _step_size(group: dict[str, Any], step: int) -> float:
    if not group["bias_correction"]:
        return group["lr"]
    beta1, beta2 = group["betas"]
    return group["lr"] * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)


def _trust_ratios(
    params: list[torch.Tensor] | tuple[torch.Tensor, ...],
    updates: list[torch.Tensor] | tuple[torch.Tensor, ...],
    min_coeff: float,
    max_coeff: float,
) -> torch.Tensor:
    """Per tensor ``clamp(||p|| / ||update||)``, 1 where either norm is 0 (no host sync)."""
    w_norms = torch.stack(torch._foreach_norm(params)).float()
    u_norms = torch.stack(torch._foreach_norm(updates)).float()
    ratios = (w_norms / u_norms).clamp(min_coeff, max_coeff)
    return torch.where((w_norms != 0) & (u_norms != 0), ratios, torch.ones_like(ratios))


def _combined_scale(
    group: dict[str, Any],
    buckets: Iterable[mt.TensorBucket],
    scale: float,
    grad_norm: float | torch.Tensor | None,
) -> float:
    """``scale``, times the clip factor when ``max_grad_norm`` > 0 (see the Note above)."""
    max_grad_norm = group["max_grad_norm"]
    if max_grad_norm <= 0:
        return float(scale)
    if grad_norm is None:
        norms = [torch.stack(torch._foreach_norm(b.grads)).float().cpu() for b in buckets]
        grad_norm = torch.cat(norms).norm()
    clip = (torch.as_tensor(grad_norm, dtype=torch.float32) / scale + 1e-6) / max_grad_norm
    return scale * float(clip.clamp(min=1.0))
