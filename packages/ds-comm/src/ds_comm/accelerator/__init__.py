"""The accelerator abstraction (``deepspeed.accelerator``): one object that answers device questions.

Code that must not assume CPU or CUDA asks ``get_accelerator()`` for device names, streams,
events, RNG state, memory figures and the communication backend. It is the lowest layer of ds,
so ds-comm, ds-zero and ds-engine all use it.

Example:
    >>> from ds_comm.accelerator import get_accelerator
    >>> acc = get_accelerator()
    >>> x = torch.ones(4, device=acc.current_device_name())
    >>> start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
    >>> start.record(); y = x * 2; end.record(); acc.synchronize()
    >>> start.elapsed_time(end)  # milliseconds, on the device's clock (the host's on CPU)
"""

from __future__ import annotations

from ds_comm.accelerator._abstract import DeepSpeedAccelerator
from ds_comm.accelerator._cpu import CPU_Accelerator
from ds_comm.accelerator._cuda import CUDA_Accelerator
from ds_comm.accelerator._host import HostEvent, HostStream
from ds_comm.accelerator._op_builders import (
    OP_BUILDER_MODULE,
    register_op_builder,
    registered_op_builders,
    unregister_op_builder,
)
from ds_comm.accelerator._select import (
    ACCELERATOR_ENV,
    SUPPORTED_ACCELERATOR_LIST,
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)

__all__ = [
    # choosing the accelerator
    "get_accelerator",
    "set_accelerator",
    "is_current_accelerator_supported",
    "ACCELERATOR_ENV",
    "SUPPORTED_ACCELERATOR_LIST",
    # implementations
    "DeepSpeedAccelerator",
    "CPU_Accelerator",
    "CUDA_Accelerator",
    "HostStream",
    "HostEvent",
    # op builders
    "register_op_builder",
    "unregister_op_builder",
    "registered_op_builders",
    "OP_BUILDER_MODULE",
]
