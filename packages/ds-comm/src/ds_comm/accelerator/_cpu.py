"""The CPU accelerator: DeepSpeed's ``CPU_Accelerator`` surface, answered from the host."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ds_comm.accelerator._abstract import DeepSpeedAccelerator
from ds_comm.accelerator._host import (
    HostEvent,
    HostMemory,
    HostStream,
    current_host_stream,
    default_host_stream,
    use_host_stream,
)

__all__ = ["CPU_Accelerator"]


def _numa_nodes_with_cpus() -> int:
    """NUMA nodes that have CPUs (memory-only nodes, e.g. HBM in flat mode, do not count)."""
    root = "/sys/devices/system/node"
    try:
        names = [n for n in os.listdir(root) if n.startswith("node") and n[4:].isdigit()]
    except OSError:
        return 1
    count = 0
    for name in names:
        try:
            with open(os.path.join(root, name, "cpulist")) as f:
                count += bool(f.read().strip())
        except OSError:
            continue
    return max(count, 1)


class CPU_Accelerator(DeepSpeedAccelerator):
    """Everything on the host: gloo for collectives, host clocks for timing, RSS for memory.

    Differences from DeepSpeed's, on purpose: :meth:`device` returns ``torch.device("cpu")``
    (DeepSpeed: None), ``Stream``/``Event`` are working host objects (DeepSpeed: None; see
    [Note: host streams and events]), ``current_device()`` is an int (DeepSpeed returns the
    ``LOCAL_RANK`` string when it is set), and ``range_push``/``range_pop`` open torch profiler
    records (DeepSpeed: nothing).
    """

    def __init__(self) -> None:
        super().__init__()
        self._name = "cpu"
        self._communication_backend_name = "gloo"
        self._compile_backend = "inductor"
        self._memory = HostMemory()
        self._ranges: list[Any] = []

    def is_synchronized_device(self) -> bool:
        return True

    # --- devices ---------------------------------------------------------------------------------

    def device_name(self, device_index: int | str | None = None) -> str:
        """Always ``"cpu"``: torch has one CPU device whatever the index."""
        return "cpu"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, device_index: int) -> None:
        """Nothing to select: every rank on a host shares the one CPU device."""
        if not isinstance(device_index, int) or device_index < 0:
            raise ValueError(f"set_device({device_index!r}): expected a device index >= 0")

    def current_device(self) -> int:
        """This rank's index on its host (``LOCAL_RANK``, 0 when unset), as DeepSpeed answers."""
        raw = os.environ.get("LOCAL_RANK", "0")
        return int(raw) if raw.strip().lstrip("-").isdigit() else 0

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        """``LOCAL_SIZE`` when the launcher set it, else NUMA nodes with CPUs (DeepSpeed's rule)."""
        raw = os.environ.get("LOCAL_SIZE", "")
        if raw.isdigit() and int(raw) > 0:
            return int(raw)
        return _numa_nodes_with_cpus()

    def synchronize(self, device_index: int | None = None) -> None:
        """CPU ops are complete when they return: nothing to wait for."""

    def is_available(self) -> bool:
        return True

    # --- random number generation ----------------------------------------------------------------

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def manual_seed(self, seed: int) -> torch.Generator:
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> torch.Generator:
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def default_generator(self, device_index: int | None = None) -> torch.Generator:
        return torch.default_generator

    # --- streams and events (see [Note: host streams and events]) --------------------------------

    @property
    def Stream(self) -> type[HostStream]:
        return HostStream

    @property
    def Event(self) -> type[HostEvent]:
        return HostEvent

    def stream(self, stream: HostStream | None) -> Any:
        return use_host_stream(stream)

    def current_stream(self, device_index: int | None = None) -> HostStream:
        return current_host_stream()

    def default_stream(self, device_index: int | None = None) -> HostStream:
        return default_host_stream()

    # --- memory (see [Note: host memory figures]) ------------------------------------------------

    def empty_cache(self) -> None:
        """The host allocator keeps no device-style cache to release."""

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self._memory.rss()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return self._memory.peak()

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self._memory.reset_peak()

    def memory_reserved(self, device_index: int | None = None) -> int:
        return self._memory.rss()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self._memory.peak()

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        current, peak = self._memory.rss(), self._memory.peak()
        return {
            "allocated_bytes.all.current": current,
            "allocated_bytes.all.peak": peak,
            "reserved_bytes.all.current": current,
            "reserved_bytes.all.peak": peak,
        }

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self._memory.reset_peak()

    def total_memory(self, device_index: int | None = None) -> int:
        return self._memory.total()

    def available_memory(self, device_index: int | None = None) -> int:
        return self._memory.available()

    # --- data types ------------------------------------------------------------------------------

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        """Whether oneDNN has float16 kernels for this CPU (DeepSpeed's test)."""
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):
            return False

    # --- misc ------------------------------------------------------------------------------------

    def range_push(self, msg: str, domain: str | None = None, category: Any = None) -> None:
        record = torch.autograd.profiler.record_function(msg)
        record.__enter__()
        self._ranges.append(record)

    def range_pop(self, domain: str | None = None) -> None:
        if not self._ranges:
            raise RuntimeError("range_pop() without a matching range_push()")
        self._ranges.pop().__exit__(None, None, None)

    def amp(self) -> Any:
        """``torch.cpu.amp`` (``autocast`` and friends for this device)."""
        return torch.cpu.amp

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return callback()

    def is_triton_supported(self) -> bool:
        return False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    def _pins_host_memory(self) -> bool:
        # No device copies from host memory here: pinning would only cost (and fails on CPU torch).
        return False

    def export_envs(self) -> list[str]:
        return []

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]
