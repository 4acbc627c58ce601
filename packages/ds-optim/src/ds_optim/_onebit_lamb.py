"""1-bit LAMB (Li et al. 2022): LAMB while the variance and trust ratios settle, then 1-bit
compressed momentum with frozen, adaptively rescaled trust ratios.

[Note: 1-bit LAMB]
1. Warmup, steps ``1..freeze_step``: gradients averaged with a full allreduce; a LAMB step per
   parameter tensor: ``update = m / (sqrt(v) + eps) + weight_decay * p``, trust ratio
   ``||p|| / ||update||`` clamped to ``[min_coeff, max_coeff]`` (1 when either norm is 0),
   ``p -= step_size * ratio * update``: exactly a :class:`FusedLamb` step. Each tensor keeps
   an exponential average of its ratios (``lamb_coeff_freeze``, weight ``coeff_beta``,
   skipping ratios of exactly 1; not bias corrected, as in DeepSpeed), and at
   ``freeze_step`` a copy of ``v`` starts as ``exp_avg_sq_fresh``.
2. Compression, later steps: ``v`` is frozen. Before the first compressed step each tensor's
   momentum gets a ``scaling_coeff`` (the mean over tensors of ``||m|| / sqrt(numel)`` divided by
   its own), so that one 1-bit scale per chunk fits all tensors of the flat group. Each rank folds
   its local gradient into ``m``, scales, compressed-allreduces, unscales. The averaged gradient
   implied by the new momentum, ``(m - beta1 m_prev) / (1 - beta1)``, keeps ``exp_avg_sq_fresh``
   current; the trust ratio is the frozen one times a factor that follows how far the frozen
   denominator has drifted: ``max(denom_frozen / denom_fresh)`` per tensor (mixed towards 1 by
   ``||update without decay|| / ||update||`` when weight decay is on), clamped to
   ``[factor_min, factor_max]`` and to within ``factor_threshold`` of its previous value.

``bias_correction`` is honoured the way :class:`FusedLamb` (DeepSpeed's fused LAMB kernel) does
it, as a step-size schedule ``step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t)`` outside the
trust ratio, at every step, so that the trust ratios and factors see the raw moments exactly as
in DeepSpeed's 1-bit LAMB and the compressed phase continues FusedLamb's step-size schedule. That one accepts ``bias_correction`` but never corrects
(its examples set it to false); ``bias_correction=False`` reproduces its updates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ds_optim._lamb import _step_size, _trust_ratios
from ds_optim._onebit_common import (
    FlatGroup,
    OneBitOptimizer,
    adam_denominator,
    check_int,
    check_number,
)
from ds_optim.api import ConfigError

__all__ = ["OneBitLamb"]


class OneBitLamb(OneBitOptimizer):
    """1-bit LAMB: LAMB for ``freeze_step`` steps, then 1-bit compressed momentum with frozen,
    adaptively rescaled trust ratios. See [Note: 1-bit LAMB].

    Give it each rank's local gradients: it averages them itself (``reduces_gradients``).
    Arguments shared with :class:`OneBitAdam` mean the same; the LAMB knobs are DeepSpeed's:

    Args:
        max_coeff: upper clamp of the trust ratio during warmup.
        min_coeff: lower clamp of the trust ratio during warmup.
        coeff_beta: weight of the running average of the trust ratios frozen at ``freeze_step``.
        factor_max: upper clamp of the factor applied to the frozen ratio.
        factor_min: lower clamp of that factor.
        factor_threshold: largest relative change of the factor from one step to the next.

    Attributes:
        lamb_coeffs: the trust ratio used for each parameter tensor in the last step.

    Example:
        >>> opt = OneBitLamb(model.parameters(), lr=1e-3, freeze_step=1000, group=dp_group)
        >>> loss_fn(model(x), y).backward()  # no gradient allreduce here
        >>> opt.step()
    """

    _ELEMENT_BUFFERS: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq", "exp_avg_sq_fresh")
    _PARAM_BUFFERS: ClassVar[Mapping[str, float]] = {
        "lamb_coeff_freeze": 0.0,
        "last_factor": 1.0,
        "scaling_coeff": 1.0,
    }
    _COUNTERS: ClassVar[Mapping[str, float]] = {"step": 0, "scaled": 0}

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
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
    ) -> None:
        owner = "OneBitLamb"
        meaning = "LAMB steps before compression starts; the frozen state needs one"
        check_int(owner, "freeze_step", freeze_step, low=1, meaning=meaning)
        check_number(owner, "coeff_beta", coeff_beta, high=1.0, high_open=True)
        check_number(owner, "factor_min", factor_min, low=1e-12, expected=" (> 0)")
        check_number(owner, "factor_max", factor_max, low=factor_min, expected=" (>= factor_min)")
        check_number(owner, "factor_threshold", factor_threshold, high=1.0)
        super().__init__(locals(), group_keys=("max_coeff", "min_coeff"))
        self.freeze_step = freeze_step
        self.coeff_beta = coeff_beta
        self.factor_max = factor_max
        self.factor_min = factor_min
        self.factor_threshold = factor_threshold
        self.lamb_coeffs: list[float] = []

    def _check_group(self, group: Mapping[str, Any]) -> None:
        super()._check_group(group)
        check_number("OneBitLamb", "min_coeff", group["min_coeff"])
        check_number("OneBitLamb", "max_coeff", group["max_coeff"])
        if group["min_coeff"] > group["max_coeff"]:
            raise ConfigError(
                f"OneBitLamb: min_coeff={group['min_coeff']!r} > max_coeff={group['max_coeff']!r}:"
                " the trust ratio clamp needs min_coeff <= max_coeff"
            )

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step on every param group; all ranks must call it (it communicates)."""
        self.lamb_coeffs = []
        return super().step(closure)

    def _step_group(self, flat: FlatGroup, group: dict[str, Any]) -> None:
        step = flat.counters["step"] = int(flat.counters["step"]) + 1
        if step <= self.freeze_step:
            coeffs = self._warmup_step(flat, group, step)
        else:
            coeffs = self._compressed_step(flat, group, step)
        self.lamb_coeffs.extend(coeffs.tolist())

    def _warmup_step(self, flat: FlatGroup, group: dict[str, Any], step: int) -> torch.Tensor:
        beta1, beta2 = group["betas"]
        exp_avg, exp_avg_sq = flat.buffers["exp_avg"], flat.buffers["exp_avg_sq"]
        grad = flat.gather_grads()
        self._average(grad)
        self._clip_(grad, group)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        del grad
        if step == self.freeze_step:
            flat.buffers["exp_avg_sq_fresh"].copy_(exp_avg_sq)
        update = exp_avg.div(adam_denominator(exp_avg_sq, 1.0, group["eps"], self.eps_inside_sqrt))
        if group["weight_decay"] > 0:
            update.add_(flat.gather_params(), alpha=group["weight_decay"])
        coeffs = _trust_ratios(
            flat.params, flat.views(update), group["min_coeff"], group["max_coeff"]
        )
        frozen = flat.buffers["lamb_coeff_freeze"]
        averaged = frozen * self.coeff_beta + coeffs * (1 - self.coeff_beta)
        frozen.copy_(torch.where(coeffs != 1.0, averaged, frozen))
        flat.add_to_params(update, alpha=-_step_size(group, step), scales=coeffs)
        return coeffs

    def _compressed_step(self, flat: FlatGroup, group: dict[str, Any], step: int) -> torch.Tensor:
        beta1, beta2 = group["betas"]
        exp_avg = flat.buffers["exp_avg"]
        scaling = flat.buffers["scaling_coeff"]
        if not flat.counters["scaled"]:
            scales = flat.norms(exp_avg) / flat.lengths.sqrt()
            scaling.copy_(torch.where(scales > 0, scales.mean() / scales, 1.0))
            flat.counters["scaled"] = 1
        previous = exp_avg.clone()
        grad = flat.gather_grads()
        self._clip_(grad, group)
        exp_avg.lerp_(grad, 1 - beta1)
        del grad
        expanded = flat.expand(scaling)
        self._compressed_average(flat, exp_avg.mul_(expanded))
        exp_avg.div_(expanded)
        del expanded
        self._mask_(exp_avg, group)
        rebuilt = previous.mul_(-beta1).add_(exp_avg).div_(1 - beta1)  # the averaged gradient
        fresh = flat.buffers["exp_avg_sq_fresh"]
        fresh.mul_(beta2).addcmul_(rebuilt, rebuilt, value=1 - beta2)
        del rebuilt, previous
        eps, inside = group["eps"], self.eps_inside_sqrt
        denom = adam_denominator(flat.buffers["exp_avg_sq"], 1.0, eps, inside)
        factors = flat.maxima(adam_denominator(fresh, 1.0, eps, inside).reciprocal_().mul_(denom))
        update = exp_avg.div(denom)
        if group["weight_decay"] > 0:
            plain_norms = flat.norms(update)
            update.add_(flat.gather_params(), alpha=group["weight_decay"])
            ratio = torch.nan_to_num(plain_norms / flat.norms(update), nan=1.0).clamp_(max=1.0)
            factors = factors * ratio + (1.0 - ratio)
        last = flat.buffers["last_factor"]
        factors = factors.clamp(self.factor_min, self.factor_max)
        factors = torch.minimum(factors, last * (1.0 + self.factor_threshold))
        factors = torch.maximum(factors, last * (1.0 - self.factor_threshold))
        last.copy_(factors)
        coeffs = flat.buffers["lamb_coeff_freeze"] * factors
        flat.add_to_params(update, alpha=-_step_size(group, step), scales=coeffs)
        return coeffs
