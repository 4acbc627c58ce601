"""``deepspeed.runtime.zero.partition_parameters``: ZeRO stage 3's construction-time helpers.

``Init``, ``GatheredParameters``, ``ZeroParamStatus`` and the external-parameter functions are
ds-zero's. The module also offers the tensor-constructor wrapper of DeepSpeed's ``Init``.

[Note: tensor constructors under Init]
DeepSpeed's ``zero.Init`` replaces ``torch.tensor``, ``empty``, ``zeros``, ``ones``, ``full``,
``arange``, ``eye`` and ``randn`` with ``zero_wrapper_for_fp_tensor_constructor(orig, dtype,
device)`` while the context is open, so every floating-point tensor built inside (buffers
included) lands on the accelerator in the training dtype; the originals stay reachable as
``_orig_torch_<name>``. transformers' ``prevent_arange_dtype_change`` swaps that wrapper for one
that leaves ``torch.arange``'s dtype alone, so RoPE's ``inv_freq`` stays fp32.

ds-zero's ``Init`` does not replace torch's constructors: it casts each module's own parameters
to the training dtype when the module's ``__init__`` returns, and leaves buffers in the dtype
they were built with (what transformers' swap is there to obtain). The wrapper and the
``_orig_torch_*`` originals are still real, with DeepSpeed's semantics, for code that wraps
constructors itself; replacing ``zero_wrapper_for_fp_tensor_constructor`` in this module changes
nothing in ds-zero's ``Init``, because it never calls it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ds_zero import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)

# torch's constructors as they were when this module was imported (DeepSpeed's names).
_orig_torch_tensor = torch.tensor
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange
_orig_torch_eye = torch.eye
_orig_torch_randn = torch.randn


def _default_device() -> torch.device:
    from ds_engine.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable[..., torch.Tensor],
    target_fp_dtype: torch.dtype,
    target_device: torch.device | str | None = None,
) -> Callable[..., torch.Tensor]:
    """``fn`` (a torch tensor constructor) building on ``target_device`` when no ``device=`` is
    given, and casting floating-point results to ``target_fp_dtype`` (see [Note: tensor
    constructors under Init]).

    Args:
        fn: e.g. ``_orig_torch_zeros``.
        target_fp_dtype: the dtype floating-point results are cast to.
        target_device: the device used when the call names none (None: the accelerator's
            current device).

    Example:
        >>> zeros = zero_wrapper_for_fp_tensor_constructor(torch.zeros, torch.bfloat16, "cpu")
        >>> zeros(3).dtype
        torch.bfloat16
    """

    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("device") is None:
            kwargs["device"] = (
                torch.device(target_device) if target_device is not None else _default_device()
            )
        tensor = fn(*args, **kwargs)
        if tensor.is_floating_point():
            tensor = tensor.to(target_fp_dtype)
        return tensor

    wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapped


def __getattr__(name: str) -> Any:
    # transformers calls ``pp.get_accelerator()`` here; the accelerator module loads on first use.
    if name == "get_accelerator":
        from ds_engine.accelerator import get_accelerator

        return get_accelerator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GatheredParameters",
    "Init",
    "ZeroParamStatus",
    "register_external_parameter",
    "unregister_external_parameter",
    "zero_wrapper_for_fp_tensor_constructor",
    "get_accelerator",  # noqa: F822  (module __getattr__)
]
