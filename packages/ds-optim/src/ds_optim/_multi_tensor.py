"""What the multi-tensor optimizers share: hyperparameter checks, fp32 state for fp16/bf16
params, and grouping a param group's tensors by device and dtype for ``torch._foreach_*`` ops."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def check_non_negative(owner: str, name: str, value: object) -> float:
    """``value`` as a float, or ValueError naming ``owner``'s argument ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{owner}: {name} must be a number >= 0, got {value!r}")
    if math.isinf(value):
        raise ValueError(f"{owner}: {name} must be finite, got {value!r}")
    return float(value)


def check_flag(owner: str, name: str, value: object) -> bool:
    """``value`` if it is a bool, or ValueError naming ``owner``'s argument ``name``."""
    if not isinstance(value, bool):
        raise ValueError(f"{owner}: {name} must be true or false, got {value!r}")
    return value


def check_betas(owner: str, betas: object) -> tuple[float, float]:
    """``betas`` as a tuple of two floats in [0, 1), or ValueError naming ``owner``."""
    try:
        beta1, beta2 = (float(b) for b in betas)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        raise ValueError(f"{owner}: betas must be two numbers, got {betas!r}") from None
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"{owner}: betas must both be in [0, 1), got {betas!r}")
    return beta1, beta2


def state_dtype(param: torch.Tensor) -> torch.dtype:
    """Optimizer state of fp16/bf16 params is fp32; other params keep their own dtype."""
    return torch.float32 if param.dtype in _LOW_PRECISION else param.dtype


def zeros_state(param: torch.Tensor, fp32: bool = True) -> torch.Tensor:
    """A zero state tensor for ``param``: see :func:`state_dtype`, or the param's own dtype
    when ``fp32`` is False (DeepSpeed's ``fp32_optimizer_states=False``)."""
    dtype = state_dtype(param) if fp32 else param.dtype
    return torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)


@dataclass
class TensorBucket:
    """Params of one param group on one device with one dtype, their grads and their states.

    The update math runs on :meth:`work_params` and :meth:`work_grads`: the tensors themselves,
    or fp32 copies for fp16/bf16 params, which :meth:`write_back` rounds into the params once.
    State kept in fp16/bf16 (``fp32_optimizer_states=False``) is read through fp32 copies too
    (:meth:`state`), rounded back into the state by :meth:`write_back`.
    """

    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    states: list[dict[str, Any]] = field(default_factory=list)
    _work: list[torch.Tensor] | None = None
    _work_states: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    @property
    def upcast(self) -> bool:
        return self.params[0].dtype in _LOW_PRECISION

    def state(self, key: str) -> list[torch.Tensor]:
        tensors = [s[key] for s in self.states]
        if not self.upcast or tensors[0].dtype not in _LOW_PRECISION:
            return tensors
        if key not in self._work_states:
            self._work_states[key] = [t.float() for t in tensors]
        return self._work_states[key]

    def work_params(self) -> list[torch.Tensor]:
        if self._work is None:
            self._work = [p.float() for p in self.params] if self.upcast else self.params
        return self._work

    def work_grads(self) -> list[torch.Tensor]:
        return [g.float() for g in self.grads] if self.upcast else list(self.grads)

    def count_step(self) -> list[int]:
        """Adds one to each param's ``state["step"]``; returns the new counts."""
        for state in self.states:
            state["step"] += 1
        return [state["step"] for state in self.states]

    def write_back(self) -> None:
        if self.upcast and self._work is not None:
            torch._foreach_copy_(self.params, self._work)
        for key, work in self._work_states.items():
            torch._foreach_copy_([s[key] for s in self.states], work)


def bucket_group(
    optimizer: torch.optim.Optimizer,
    group: dict[str, Any],
    init_state: Callable[[torch.Tensor], dict[str, Any]],
    extra_key: Callable[[dict[str, Any]], Hashable] | None = None,
) -> dict[Hashable, TensorBucket]:
    """Sorts ``group``'s params that have a grad into buckets by (device, dtype[, extra]).

    ``init_state(param)`` makes a param's first state; ``extra_key(state)`` splits buckets
    further (e.g. by step count). Raises for sparse grads and non-floating params.
    """
    owner = type(optimizer).__name__
    buckets: dict[Hashable, TensorBucket] = {}
    for p in group["params"]:
        if p.grad is None:
            continue
        if p.grad.is_sparse:
            raise RuntimeError(f"{owner} does not support sparse gradients")
        if not p.is_floating_point():
            raise RuntimeError(f"{owner} updates floating-point params only, got {p.dtype}")
        state = optimizer.state[p]
        if not state:
            state.update(init_state(p))
        key: Hashable = (p.device, p.dtype)
        if extra_key is not None:
            key = (*key, extra_key(state))
        bucket = buckets.setdefault(key, TensorBucket())
        bucket.params.append(p)
        bucket.grads.append(p.grad)
        bucket.states.append(state)
    return buckets


def iter_buckets(
    optimizer: torch.optim.Optimizer,
    init_state: Callable[[torch.Tensor], dict[str, Any]],
    extra_key: Callable[[dict[str, Any]], Hashable] | None = None,
) -> Iterator[tuple[dict[str, Any], Hashable, TensorBucket]]:
    """``(group, key, bucket)`` for every bucket of every param group (see :func:`bucket_group`)."""
    for group in optimizer.param_groups:
        for key, bucket in bucket_group(optimizer, group, init_state, extra_key).items():
            yield group, key, bucket


def run_closure(closure: Callable[[], Any] | None) -> Any:
    """Runs ``closure`` with grad enabled (``step`` itself runs under ``no_grad``)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class FP32StateOptimizer(torch.optim.Optimizer):
    """Base of the ds_optim optimizers that keep fp32 state for fp16/bf16 params.

    ``torch.optim.Optimizer.load_state_dict`` casts floating state to the param's dtype, which
    would round fp32 moments to bf16; this class restores them in fp32 after loading. It also
    gives ``zero_grad`` DeepSpeed's ``set_grad_none`` default.
    """

    set_grad_none: bool = True
    fp32_optimizer_states: bool = True

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clears grads: to None when ``set_to_none`` (default: ``set_grad_none``), else zeroes."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads ``state_dict`` as torch does, keeping fp32 state of fp16/bf16 params in fp32."""
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        saved_state = state_dict["state"]
        fp32_state = {
            pid: {k: v for k, v in saved_state[pid].items() if _is_fp32_tensor(v)}
            for pid in saved_ids
            if pid in saved_state
        }
        super().load_state_dict(state_dict)
        for pid, param in zip(saved_ids, params):
            if param.dtype in _LOW_PRECISION and pid in fp32_state:
                for key, value in fp32_state[pid].items():
                    self.state[param][key] = value.to(device=param.device)


def _is_fp32_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.float32
