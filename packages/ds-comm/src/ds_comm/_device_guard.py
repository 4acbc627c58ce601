"""Device guard: a test mode in which every collective checks its tensors' devices first.

[Note: device guard]
Code written on a CPU box tends to leave a tensor on the host that must be on the GPU (or the
reverse), and the mistake shows only on the other kind of machine, as a backend error deep in
NCCL or as a silent host-device copy through gloo. With the guard on (``DS_DEVICE_GUARD=1`` in
the environment when ds-comm is imported, or :func:`device_guard`), every ds-comm collective
and point-to-point call checks each tensor argument before it is issued, against the device the
accelerator reports for this process (``get_accelerator().current_device_name()``):

- on an NCCL group, tensors must be on exactly that device (e.g. ``cuda:3``);
- on a gloo (or MPI, or mixed ``cpu:gloo,cuda:nccl``) group, host tensors are legal, and so are
  tensors on that accelerator device, which gloo stages through the host;
- with the CPU accelerator, only host tensors are legal.

A tensor elsewhere (another GPU, ``meta``, a CPU tensor on NCCL) raises
:class:`~ds_comm.api.DeviceGuardError` naming the op, the rank, the tensor's device and the
expected device, before the call is registered or issued. The check is made where every call
is registered (``_instrument.begin``), so no op can skip it; when the guard is off it costs one
attribute read per call.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ds_comm._instrument import TRACKER
from ds_comm.api import ConfigError, DeviceGuardError

__all__ = ["GUARD_ENV", "device_guard", "expected_devices"]

GUARD_ENV = "DS_DEVICE_GUARD"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
_CPU = torch.device("cpu")


def expected_devices(group: Any) -> tuple[torch.device, ...]:
    """The devices tensors of a call on ``group`` may live on (see [Note: device guard])."""
    from ds_comm.accelerator import get_accelerator

    current = torch.device(get_accelerator().current_device_name())
    if current.type == "cpu":
        return (_CPU,)
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return (current,)
    return (_CPU, current)


def group_device(group: Any = None) -> torch.device:
    """The device for ds's own small tensors on ``group`` (flags, norms, headers, object bytes).

    The accelerator's device for an NCCL-only group, else the host: gloo takes host tensors on
    every build, so control traffic on a gloo group never forces a host-device copy.
    """
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend and "cpu:" not in backend:
        from ds_comm.accelerator import get_accelerator

        return torch.device(get_accelerator().current_device_name())
    return _CPU


def _check(op: str, group: Any, tensors: Sequence[torch.Tensor]) -> None:
    allowed = expected_devices(group)
    for index, tensor in enumerate(tensors):
        if tensor.device in allowed:
            continue
        rank = dist.get_rank() if dist.is_initialized() else 0
        backend = str(dist.get_backend(group))
        expected = " or ".join(str(d) for d in allowed)
        raise DeviceGuardError(
            f"device guard: {op} on rank {rank} got a tensor on {tensor.device} (argument "
            f"tensor {index} of {len(tensors)}, shape {tuple(tensor.shape)}); expected "
            f"{expected} for this {backend} group (get_accelerator().current_device_name()); "
            f"move it with .to({str(allowed[-1])!r})"
        )


def device_guard(enabled: bool | None = None) -> bool:
    """Turn the device guard on or off (None: leave it); returns the previous state.

    Example:
        >>> previous = ds_comm.device_guard(True)
        >>> ds_comm.all_reduce(torch.ones(2, device="meta"))  # raises DeviceGuardError
        >>> ds_comm.device_guard(previous)
    """
    previous = TRACKER.device_check is not None
    if enabled is not None:
        if not isinstance(enabled, bool):
            raise TypeError(f"device_guard(enabled={enabled!r}): expected True, False or None")
        TRACKER.device_check = _check if enabled else None
    return previous


def _from_env() -> None:
    raw = os.environ.get(GUARD_ENV, "")
    value = raw.strip().lower()
    if value in _TRUE:
        device_guard(True)
    elif value not in _FALSE:
        raise ConfigError(
            f"{GUARD_ENV}={raw!r}: expected 1/true/yes/on or 0/false/no/off (or unset)"
        )


_from_env()
