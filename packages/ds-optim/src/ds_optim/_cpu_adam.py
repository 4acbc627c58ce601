"""CPUAdam: Adam/AdamW on CPU with ds_native's C kernel (DeepSpeed's ``DeepSpeedCPUAdam``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

import ds_native
from ds_optim import _multi_tensor as mt

_HALF = (torch.float16, torch.bfloat16)

CopyTargets = torch.Tensor | Sequence[torch.Tensor] | Sequence[Sequence[torch.Tensor]]
"""``step(fp16_param_groups=...)``: one tensor, one per param of a single group, or per group."""


class CPUAdam(mt.FP32StateOptimizer):
    """Adam and AdamW for parameters in CPU memory (ZeRO-Offload's optimizer).

    Drop-in for DeepSpeed's ``DeepSpeedCPUAdam``: each param's update is one pass of
    :func:`ds_native.adam_step` (AVX-512/AVX2 C code on all of ``torch.get_num_threads()``
    threads) over the fp32 param, its grad (fp32, fp16 or bf16) and its fp32 ``exp_avg`` and
    ``exp_avg_sq``, equal to ``torch.optim.AdamW`` (``adamw_mode=True``, the default) or
    ``torch.optim.Adam`` (``adamw_mode=False``: weight decay added to the gradient) up to
    rounding. ``step(fp16_param_groups=...)`` also writes the updated params into fp16/bf16
    tensors in the same pass, as ZeRO-Offload does to refresh the low-precision model. Other
    params (fp16/bf16 ones, non-contiguous ones) take the torch reference path, computed in fp32.

    The state has ``torch.optim.Adam``'s layout (``step`` as a float32 tensor, ``exp_avg``,
    ``exp_avg_sq``), so state dicts load across the two. Every group hyperparameter (``lr``,
    ``betas``, ``eps``, ``weight_decay``, ``bias_correction``, ``adamw_mode``) can be set per
    param group.

    Args:
        model_params: Params or param groups, on the CPU.
        lr: Learning rate.
        bias_correction: Divide the moments by ``1 - beta**step``.
        betas: Decay rates of the first and second moments.
        eps: Added to the bias-corrected ``sqrt(exp_avg_sq)``.
        weight_decay: Weight decay factor.
        amsgrad: Not supported; True raises.
        adamw_mode: Decoupled weight decay (AdamW) when True, L2 regularisation when False.
        fp32_optimizer_states: Keep ``exp_avg``/``exp_avg_sq`` in fp32 for fp16/bf16 params
            (else in the param's dtype).
        num_threads: Threads for the C kernel; None uses ``torch.get_num_threads()``.

    Raises:
        ValueError: ``amsgrad=True`` or an out-of-range hyperparameter.

    Example:
        >>> opt = ds_optim.CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
        >>> loss.backward(); opt.step(); opt.zero_grad()
        >>> opt.step(fp16_param_groups=[[bf16_flat_partition]])  # fused copy-out
    """

    def __init__(
        self,
        model_params: Iterable[Any],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
        *,
        num_threads: int | None = None,
    ) -> None:
        if amsgrad:
            raise ValueError(
                "CPUAdam: amsgrad=True is not supported (DeepSpeed's CPUAdam has no AMSGrad); "
                "use torch.optim.Adam(amsgrad=True), or the optimizer config "
                '{"type": "Adam", "params": {"torch_adam": true, "amsgrad": true}}'
            )
        if num_threads is not None and (isinstance(num_threads, bool) or num_threads < 1):
            raise ValueError(f"CPUAdam: num_threads must be a positive int, got {num_threads!r}")
        defaults = {
            "lr": mt.check_non_negative("CPUAdam", "lr", lr),
            "betas": mt.check_betas("CPUAdam", betas),
            "eps": mt.check_non_negative("CPUAdam", "eps", eps),
            "weight_decay": mt.check_non_negative("CPUAdam", "weight_decay", weight_decay),
            "bias_correction": bool(bias_correction),
            "adamw_mode": bool(adamw_mode),
        }
        super().__init__(model_params, defaults)
        self.fp32_optimizer_states = bool(fp32_optimizer_states)
        self.num_threads = num_threads

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Groups from a torch.optim.Adam state dict lack CPUAdam's keys: use the defaults.
        super().__setstate__(state)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    @torch.no_grad()
    def step(  # type: ignore[override]
        self,
        closure: Callable[[], Any] | None = None,
        fp16_param_groups: CopyTargets | None = None,
    ) -> Any:
        """Takes one step for every param that has a grad; returns ``closure()`` if given.

        Args:
            closure: Re-evaluates the model and returns the loss.
            fp16_param_groups: fp16/bf16 tensors that receive the updated params, indexed like
                ``param_groups`` (``[group][param]``); a flat list is taken as the only group's,
                a single tensor as the only param's. A target of the param's size in CPU memory
                is written by the kernel in the same pass; any other (e.g. on a GPU) is copied
                to afterwards.
        """
        loss = mt.run_closure(closure)
        targets = _copy_targets(fp16_param_groups)
        for group_index, group in enumerate(self.param_groups):
            for param_index, param in enumerate(group["params"]):
                if param.grad is None:
                    continue
                target = None
                if targets is not None:
                    target = _target(targets, group_index, param_index)
                self._update(group, param, target)
        return loss

    def _update(
        self, group: dict[str, Any], param: torch.Tensor, target: torch.Tensor | None
    ) -> None:
        if param.device.type != "cpu":
            raise RuntimeError(
                f"CPUAdam: params must be in CPU memory, got one on {param.device}; with ZeRO, "
                'enable "offload_optimizer": {"device": "cpu"}, else use FusedAdam'
            )
        grad = param.grad
        assert grad is not None  # step() skips parameters without one
        if grad.is_sparse:
            raise RuntimeError("CPUAdam does not support sparse gradients")
        state = self.state[param]
        if not state:
            state.update(self._initial_state(param))
        step = _advance(state)
        fused = _fusable_copy(param, target)
        ds_native.adam_step(
            param,
            grad,
            state["exp_avg"],
            state["exp_avg_sq"],
            step=step,
            lr=group["lr"],
            betas=group["betas"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            adamw_mode=group["adamw_mode"],
            bias_correction=group["bias_correction"],
            param_copy=fused,
            num_threads=self.num_threads,
        )
        if target is not None and fused is None:
            target.copy_(param.detach().reshape(target.shape))

    def _initial_state(self, param: torch.Tensor) -> dict[str, Any]:
        dtype = param.dtype
        if self.fp32_optimizer_states and dtype in _HALF:
            dtype = torch.float32
        return {
            # torch.optim.Adam's layout: a float32 scalar tensor on the CPU.
            "step": torch.tensor(0.0, dtype=torch.float32),
            "exp_avg": torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format),
        }


def _advance(state: dict[str, Any]) -> int:
    """Counts one more step for a param (each param counts its own); returns the new count."""
    step = state["step"]
    if not isinstance(step, torch.Tensor):  # an int, from a DeepSpeed checkpoint
        step = state["step"] = torch.tensor(float(step), dtype=torch.float32)
    step += 1
    return int(step.item())


def _copy_targets(targets: CopyTargets | None) -> Sequence[Sequence[torch.Tensor]] | None:
    """DeepSpeed's accepted forms of ``fp16_param_groups`` as ``[group][param]``."""
    if targets is None:
        return None
    if isinstance(targets, torch.Tensor):
        return [[targets]]
    if len(targets) > 0 and isinstance(targets[0], torch.Tensor):
        return [targets]  # type: ignore[list-item]
    return targets  # type: ignore[return-value]


def _target(
    targets: Sequence[Sequence[torch.Tensor]], group_index: int, param_index: int
) -> torch.Tensor:
    try:
        target = targets[group_index][param_index]
    except IndexError:
        raise ValueError(
            f"CPUAdam.step: fp16_param_groups has no tensor for param {param_index} of group "
            f"{group_index}; pass one per param, indexed like param_groups"
        ) from None
    if target.dtype not in _HALF:
        raise TypeError(
            f"CPUAdam.step: fp16_param_groups[{group_index}][{param_index}] must be float16 or "
            f"bfloat16, got {target.dtype}"
        )
    return target


def _fusable_copy(param: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor | None:
    """``target`` viewed as ``param`` when the kernel can write it in the same pass, else None."""
    if target is None:
        return None
    if target.numel() != param.numel():
        raise ValueError(
            f"CPUAdam.step: a fp16_param_groups tensor has {target.numel()} elements for a "
            f"param of {param.numel()}; they must be the same size"
        )
    if target.device.type != "cpu" or not target.is_contiguous():
        return None
    return target.view(param.shape)
