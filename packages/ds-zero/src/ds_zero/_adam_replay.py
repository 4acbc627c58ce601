"""torch's Adam and AdamW stepped over slices of a flat CPU master without calling their
``step`` per slice (see [Note: replaying torch's Adam over slices])."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["replay_adam_in_slices"]

# [Note: replaying torch's Adam over slices]
# ``step_in_slices`` calls ``optimizer.step()`` once per slice. For torch's Adam and AdamW on a
# large master that costs twice. Measured on an H200 host (16 cores, 8 threads), 981M elements
# in slices of 2**20: 936 calls took ~0.6 ms of Python each, and every call allocated two
# slice-sized temporaries (``exp_avg_sq.sqrt()`` and the division after it) that page-fault in
# afresh. The sliced step took 2.37 s against 1.93 s for the whole one.
#
# So for those two exact types the step is replayed here, slice by slice: the same elementwise
# ops, in the same order, with the same Python-float scalars as torch's single-tensor
# implementation, and one reused scratch slice for the denominator. The scalar state (``step``)
# advances once per group, as in torch.
#
# That the replay equals torch's own step is checked, not assumed. Once per process and
# optimizer configuration, both step the same small random tensors with the group's
# hyperparameters and must agree bit for bit (``_replays_torch``). When they do not (another
# torch version computing otherwise), ``step_in_slices`` steps the slices through
# ``optimizer.step()`` as before.
#
# Only the plain configuration is replayed: no amsgrad, maximize, capturable, differentiable,
# foreach or fused, and float hyperparameters. Anything else goes through ``optimizer.step()``.

_REPLAYED = (torch.optim.Adam, torch.optim.AdamW)
_OFF_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable", "foreach", "fused")
_PROBE_NUMEL = 4096 + 13  # vector loops and their scalar tails
_verdicts: dict[tuple[Any, ...], bool] = {}


def replay_adam_in_slices(
    optimizer: torch.optim.Optimizer, masters: Sequence[torch.Tensor | None], numel: int
) -> bool:
    """Step torch's Adam/AdamW over ``numel``-element slices of each group's flat master when it
    is replayable (see the Note); return whether it did.

    ``masters`` are each param group's one flat CPU master (None for an empty group), with
    ``.grad`` set and the optimizer's state created (``_step_slices._sliceable_masters``).
    """
    if type(optimizer) not in _REPLAYED:
        return False
    groups = optimizer.param_groups
    if not all(_plain(group) for group in groups):
        return False
    for master in masters:
        state = optimizer.state.get(master) if master is not None else None
        if master is not None and not (
            state and torch.is_tensor(state.get("step")) and "exp_avg_sq" in state
        ):
            return False
    if not all(_replays_torch(type(optimizer), group) for group in groups):
        return False
    with torch.no_grad():
        _replay(optimizer, masters, numel)
    return True


def _replay(
    optimizer: torch.optim.Optimizer, masters: Sequence[torch.Tensor | None], numel: int
) -> None:
    for group, master in zip(optimizer.param_groups, masters):
        if master is None:
            continue
        grad = master.grad
        assert grad is not None  # checked by _sliceable_masters
        state = optimizer.state[master]
        state["step"] += 1
        scalars = _scalars(type(optimizer), group, state["step"].item())
        scratch = torch.empty(min(numel, master.numel()), dtype=master.dtype)
        grad_scratch = torch.empty_like(scratch) if scalars["l2"] else None
        for start in range(0, master.numel(), numel):
            length = min(numel, master.numel() - start)
            _adam_slice(
                master.narrow(0, start, length),
                grad.narrow(0, start, length),
                state["exp_avg"].narrow(0, start, length),
                state["exp_avg_sq"].narrow(0, start, length),
                scratch.narrow(0, 0, length),
                None if grad_scratch is None else grad_scratch.narrow(0, 0, length),
                scalars,
            )


def _plain(group: dict[str, Any]) -> bool:
    numbers = (group["lr"], *group["betas"], group["eps"], group["weight_decay"])
    return not any(group.get(flag) for flag in _OFF_FLAGS) and all(
        isinstance(x, (float, int)) and not isinstance(x, bool) for x in numbers
    )


def _decoupled(kind: type[torch.optim.Optimizer], group: dict[str, Any]) -> bool:
    return bool(group.get("decoupled_weight_decay", kind is torch.optim.AdamW))


def _scalars(
    kind: type[torch.optim.Optimizer], group: dict[str, Any], step: float
) -> dict[str, Any]:
    """The Python floats torch's single-tensor Adam computes for this step, as it computes them."""
    lr, (beta1, beta2), eps, weight_decay = (
        group["lr"],
        group["betas"],
        group["eps"],
        group["weight_decay"],
    )
    decoupled = _decoupled(kind, group)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    return {
        "decay": 1 - lr * weight_decay if weight_decay != 0 and decoupled else None,
        "l2": weight_decay if weight_decay != 0 and not decoupled else None,
        "beta1_weight": 1 - beta1,
        "beta2": beta2,
        "beta2_weight": 1 - beta2,
        "bias_correction2_sqrt": bias_correction2**0.5,
        "eps": eps,
        "neg_step_size": -(lr / bias_correction1),
    }


def _adam_slice(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    scratch: torch.Tensor,
    grad_scratch: torch.Tensor | None,
    scalars: dict[str, Any],
) -> None:
    """One slice of torch's single-tensor Adam step (plain configuration), in its op order."""
    if scalars["decay"] is not None:
        param.mul_(scalars["decay"])
    if scalars["l2"] is not None:
        assert grad_scratch is not None
        grad = torch.add(grad, param, alpha=scalars["l2"], out=grad_scratch)
    exp_avg.lerp_(grad, scalars["beta1_weight"])
    exp_avg_sq.mul_(scalars["beta2"]).addcmul_(grad, grad, value=scalars["beta2_weight"])
    denom = torch.sqrt(exp_avg_sq, out=scratch).div_(scalars["bias_correction2_sqrt"])
    param.addcdiv_(exp_avg, denom.add_(scalars["eps"]), value=scalars["neg_step_size"])


def _replays_torch(kind: type[torch.optim.Optimizer], group: dict[str, Any]) -> bool:
    """Whether the replay equals ``kind``'s own step for this configuration, bit for bit
    (probed once per process and configuration)."""
    key = (kind, _decoupled(kind, group), group["weight_decay"] != 0)
    if key not in _verdicts:
        _verdicts[key] = _probe(kind, group)
    return _verdicts[key]


def _probe(kind: type[torch.optim.Optimizer], group: dict[str, Any]) -> bool:
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(_PROBE_NUMEL, generator=gen)
    grad = torch.randn(_PROBE_NUMEL, generator=gen) * 1e-2
    exp_avg = torch.randn(_PROBE_NUMEL, generator=gen) * 1e-3
    exp_avg_sq = torch.rand(_PROBE_NUMEL, generator=gen) * 1e-5
    step = torch.tensor(6.0)
    accepted = inspect.signature(kind.__init__).parameters
    options = {k: v for k, v in group.items() if k != "params" and k in accepted}
    reference = torch.nn.Parameter(param.clone())
    reference.grad = grad.clone()
    optimizer = kind([reference], **options)
    optimizer.state[reference] = {
        "step": step.clone(),
        "exp_avg": exp_avg.clone(),
        "exp_avg_sq": exp_avg_sq.clone(),
    }
    optimizer.step()
    scalars = _scalars(kind, group, float(step) + 1)
    with torch.no_grad():
        _adam_slice(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            torch.empty_like(param),
            torch.empty_like(param),
            scalars,
        )
    state = optimizer.state[reference]
    return (
        torch.equal(reference.detach(), param)
        and torch.equal(state["exp_avg"], exp_avg)
        and torch.equal(state["exp_avg_sq"], exp_avg_sq)
    )
