"""Which accelerator the process uses: ``DS_ACCELERATOR``, else CUDA when present, else CPU."""

from __future__ import annotations

import os
import threading

import torch

from ds_comm.accelerator._abstract import DeepSpeedAccelerator
from ds_comm.accelerator._cpu import CPU_Accelerator
from ds_comm.accelerator._cuda import CUDA_Accelerator
from ds_comm.api import ConfigError

__all__ = [
    "ACCELERATOR_ENV",
    "SUPPORTED_ACCELERATOR_LIST",
    "get_accelerator",
    "is_current_accelerator_supported",
    "set_accelerator",
]

ACCELERATOR_ENV = "DS_ACCELERATOR"
# The accelerators ds implements (DeepSpeed also knows xpu, npu, mps, hpu, mlu, sdaa, supa, klxpu).
SUPPORTED_ACCELERATOR_LIST = ["cuda", "cpu"]
_DEEPSPEED_ONLY = ("xpu", "npu", "mps", "hpu", "mlu", "sdaa", "supa", "klxpu")

_lock = threading.Lock()
_current: DeepSpeedAccelerator | None = None


def _from_env(raw: str) -> DeepSpeedAccelerator:
    name = raw.strip().lower()
    if name == "cpu":
        return CPU_Accelerator()
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"{ACCELERATOR_ENV}={raw!r} but torch.cuda.is_available() is False (torch "
                f"{torch.__version__}, CUDA build {torch.version.cuda}); use a CUDA build of "
                f"torch on a GPU host, or {ACCELERATOR_ENV}=cpu"
            )
        return CUDA_Accelerator()
    if name in _DEEPSPEED_ONLY:
        raise ConfigError(
            f"{ACCELERATOR_ENV}={raw!r}: the {name} accelerator is not implemented in ds; "
            f"choose one of {SUPPORTED_ACCELERATOR_LIST}, or pass your own DeepSpeedAccelerator "
            "subclass to set_accelerator()"
        )
    raise ConfigError(
        f"{ACCELERATOR_ENV}={raw!r} is not an accelerator; choose one of "
        f"{SUPPORTED_ACCELERATOR_LIST} (or unset it to pick CUDA when available, else CPU)"
    )


def get_accelerator() -> DeepSpeedAccelerator:
    """The process's accelerator, chosen on first call.

    ``DS_ACCELERATOR`` (``"cpu"`` or ``"cuda"``) picks one; otherwise CUDA when
    ``torch.cuda.is_available()``, else CPU. :func:`set_accelerator` overrides the choice.

    Raises:
        ConfigError: ``DS_ACCELERATOR`` names no implemented accelerator, or asks for CUDA
            where there is none.

    Example:
        >>> acc = get_accelerator()
        >>> x = torch.zeros(4, device=acc.current_device_name())
    """
    global _current
    found = _current
    if found is not None:
        return found
    with _lock:
        if _current is None:
            raw = os.environ.get(ACCELERATOR_ENV)
            if raw is not None and raw.strip():
                _current = _from_env(raw)
            elif torch.cuda.is_available():
                _current = CUDA_Accelerator()
            else:
                _current = CPU_Accelerator()
        return _current


def set_accelerator(accel_obj: DeepSpeedAccelerator | None) -> None:
    """Use ``accel_obj`` from now on (None: choose again at the next :func:`get_accelerator`).

    Raises:
        TypeError: ``accel_obj`` is not a :class:`DeepSpeedAccelerator`.
    """
    global _current
    if accel_obj is not None and not isinstance(accel_obj, DeepSpeedAccelerator):
        raise TypeError(
            f"set_accelerator: {type(accel_obj).__name__} is not a subclass of DeepSpeedAccelerator"
        )
    with _lock:
        _current = accel_obj


def is_current_accelerator_supported() -> bool:
    """Whether the accelerator in use is one ds implements (``cuda`` or ``cpu``)."""
    return get_accelerator().device_name() in SUPPORTED_ACCELERATOR_LIST
