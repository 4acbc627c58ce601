"""DeepSpeed's parameter-access API (``safe_get_full_fp32_param`` and siblings): read and write a
model parameter's fp32 master, optimizer state and gradient wherever its ZeRO optimizer keeps
them, at stages 0-3, through ``ds_zero.param_views`` (see its [Note: parameter views]).

``full`` getters are collectives over the parameter's data-parallel group (every rank calls
them, in the same order) and return fp32 tensors shaped like the parameter; ``full`` setters
take the whole value on every rank and write this rank's part. ``local`` functions read and
write only this rank's part: stage 3's partition (``ceil(numel / world)`` elements, padding
included, as DeepSpeed's), or at stages 0-2 the elements of the parameter this rank's optimizer
shard holds (DeepSpeed allows the local API only at stage 3). Gradients exist between a backward
and the step after it; with fp16 they carry the loss scale, as DeepSpeed's do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

import ds_zero

__all__ = [
    "get_full_hp_grad",
    "get_full_hp_param",
    "set_full_hp_grad",
    "set_full_hp_param",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
]

_RESERVED = ("param", "grad")


def _views(param: torch.Tensor, what: str) -> ds_zero.ParamViews:
    views = ds_zero.param_views(param)
    if views is None:
        raise ValueError(
            f"{what}: this parameter is not trained by a ZeRO optimizer (it is frozen, or not "
            "among the parameters given to deepspeed.initialize, or its engine is gone)"
        )
    return views


def _key(optim_state_key: str) -> str:
    if optim_state_key in _RESERVED:
        raise ValueError(
            f"optim_state_key={optim_state_key!r} names no optimizer state; use "
            "safe_get_full_fp32_param / safe_get_full_grad for the weight and the gradient"
        )
    return optim_state_key


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """The whole fp32 master value of ``param`` (None when no ZeRO optimizer trains it).

    Example:
        >>> w = safe_get_full_fp32_param(engine.module.fc.weight)  # on every rank
    """
    views = ds_zero.param_views(param)
    return views.full("param") if views is not None else None


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Set ``param``'s fp32 master (and the model's weight) from the whole ``value``, given on
    every rank."""
    _views(param, "safe_set_full_fp32_param").set_full("param", value)


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """The whole fp32 optimizer state ``optim_state_key`` (e.g. ``"exp_avg"``) of ``param``
    (None when no ZeRO optimizer trains it; KeyError naming the existing keys for another)."""
    views = ds_zero.param_views(param)
    return views.full(_key(optim_state_key)) if views is not None else None


def safe_set_full_optimizer_state(
    param: torch.Tensor, value: torch.Tensor, optim_state_key: str
) -> None:
    """Set ``param``'s optimizer state ``optim_state_key`` from the whole ``value``."""
    _views(param, "safe_set_full_optimizer_state").set_full(_key(optim_state_key), value)


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The whole gradient of ``param`` as the step will use it (reduced over the data-parallel
    group at the accumulation boundary), fp32; for a parameter no ZeRO optimizer trains, its
    ``.grad`` (None without one)."""
    views = ds_zero.param_views(param)
    if views is None:
        return param.grad
    return views.full("grad")


def safe_set_full_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Replace ``param``'s gradient by the whole ``value`` (between backward and step); for a
    parameter no ZeRO optimizer trains, its ``.grad``."""
    views = ds_zero.param_views(param)
    if views is None:
        if param.grad is None:
            raise ValueError(
                "safe_set_full_grad: the parameter has no gradient and no ZeRO optimizer trains it"
            )
        param.grad.copy_(value)
        return
    views.set_full("grad", value)


def safe_update_full_grad_vectorized(
    param_list: Sequence[torch.Tensor],
    update_func: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> None:
    """For each parameter, replace its gradient by ``update_func(full_grad, param)``
    (collective: every rank passes the same parameters)."""
    for p in param_list:
        if not p.requires_grad:
            continue
        grad = safe_get_full_grad(p)
        if grad is not None:
            safe_set_full_grad(p, update_func(grad, p))


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of ``param``'s fp32 master (a view: writes go through)."""
    return _views(param, "safe_get_local_fp32_param").local("param")


def safe_set_local_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Overwrite this rank's part of ``param``'s fp32 master (and of its weight)."""
    _views(param, "safe_set_local_fp32_param").set_local("param", value)


def safe_get_local_optimizer_state(
    param: torch.Tensor, optim_state_key: str
) -> torch.Tensor | None:
    """This rank's part of ``param``'s optimizer state ``optim_state_key``."""
    return _views(param, "safe_get_local_optimizer_state").local(_key(optim_state_key))


def safe_set_local_optimizer_state(
    param: torch.Tensor, value: torch.Tensor, optim_state_key: str
) -> None:
    """Overwrite this rank's part of ``param``'s optimizer state ``optim_state_key``."""
    _views(param, "safe_set_local_optimizer_state").set_local(_key(optim_state_key), value)


def safe_get_local_grad(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of ``param``'s gradient (None after the step freed it)."""
    return _views(param, "safe_get_local_grad").local("grad")


def safe_set_local_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Overwrite this rank's part of ``param``'s gradient."""
    _views(param, "safe_set_local_grad").set_local("grad", value)


# DeepSpeed binds these to its parameters as methods (``param.get_full_hp_param()``); here they
# are functions of the parameter, with the same meaning.


def get_full_hp_param(param: torch.Tensor, optim_state_key: str | None = None) -> torch.Tensor:
    """The whole fp32 master (or optimizer state ``optim_state_key``) of ``param``; collective."""
    kind = "param" if optim_state_key is None else _key(optim_state_key)
    return _views(param, "get_full_hp_param").full(kind)


def set_full_hp_param(
    param: torch.Tensor, value: torch.Tensor, optim_state_key: str | None = None
) -> None:
    """Write this rank's part of the whole ``value`` into ``param``'s master (or state)."""
    kind = "param" if optim_state_key is None else _key(optim_state_key)
    _views(param, "set_full_hp_param").set_full(kind, value)


def get_full_hp_grad(param: torch.Tensor) -> torch.Tensor:
    """The whole fp32 gradient of ``param``; collective."""
    return _views(param, "get_full_hp_grad").full("grad")


def set_full_hp_grad(param: torch.Tensor, value: torch.Tensor) -> None:
    """Write this rank's part of the whole ``value`` into ``param``'s gradient."""
    _views(param, "set_full_hp_grad").set_full("grad", value)
