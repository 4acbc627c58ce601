"""The accelerator interface (DeepSpeed's ``DeepSpeedAccelerator``): what every device must answer.

Device-specific queries (devices, RNG, streams, memory, dtypes) are abstract; what is the same on
every device (pinned host memory, the compile backend, visible-device variables, op builders) is
implemented here once.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import torch

from ds_comm.accelerator import _op_builders

__all__ = ["DeepSpeedAccelerator"]


class DeepSpeedAccelerator(abc.ABC):
    """One kind of device as DeepSpeed code sees it (``deepspeed.accelerator``'s base class).

    Subclass it and pass an instance to :func:`set_accelerator` to run ds on another device kind.
    ``_name``, ``_communication_backend_name`` and ``_compile_backend`` are attributes DeepSpeed
    clients read directly.
    """

    supports_nvtx_domain = False

    def __init__(self) -> None:
        self._name: str = "unknown"
        self._communication_backend_name: str = "gloo"
        self._compile_backend: str = "inductor"

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self._name!r})"

    # --- execution model -------------------------------------------------------------------------

    @abc.abstractmethod
    def is_synchronized_device(self) -> bool:
        """True when ops complete before they return (no streams to wait on)."""

    def use_host_timers(self) -> bool:
        """Whether wall-clock timers measure device work (true on synchronized devices)."""
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        """Whether the device orders dependent ops by itself (no stream syncs needed)."""
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        """Whether freeing memory needs no explicit synchronisation with queued work."""
        return self.is_synchronized_device()

    # --- devices ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def device_name(self, device_index: int | str | None = None) -> str:
        """``"cuda"`` or ``"cuda:1"``-style name (the bare kind when no index)."""

    @abc.abstractmethod
    def device(self, device_index: int | None = None) -> torch.device:
        """The ``torch.device`` of index ``device_index``."""

    @abc.abstractmethod
    def set_device(self, device_index: int) -> None:
        """Make ``device_index`` this process's current device."""

    @abc.abstractmethod
    def current_device(self) -> int:
        """Index of this process's current device."""

    @abc.abstractmethod
    def current_device_name(self) -> str:
        """Name of the current device, e.g. ``"cuda:3"``; tensors for collectives live there."""

    @abc.abstractmethod
    def device_count(self) -> int:
        """Devices of this kind visible to the process."""

    @abc.abstractmethod
    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for all queued work on the device."""

    @abc.abstractmethod
    def is_available(self) -> bool:
        """Whether this device kind can run here."""

    # --- random number generation ----------------------------------------------------------------

    def random(self) -> Any:
        """The ``torch.random`` module (seeding helpers)."""
        return torch.random

    @abc.abstractmethod
    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        """Restore a generator state from :meth:`get_rng_state`."""

    @abc.abstractmethod
    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        """The device generator's state as a byte tensor."""

    @abc.abstractmethod
    def manual_seed(self, seed: int) -> Any:
        """Seed the current device's generator."""

    @abc.abstractmethod
    def manual_seed_all(self, seed: int) -> Any:
        """Seed every device's generator."""

    @abc.abstractmethod
    def initial_seed(self) -> int:
        """The seed the current device's generator started from."""

    @abc.abstractmethod
    def default_generator(self, device_index: int) -> torch.Generator:
        """The default ``torch.Generator`` of device ``device_index``."""

    # --- streams and events ----------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def Stream(self) -> type:
        """The stream class (construct with ``Stream()``)."""

    @property
    @abc.abstractmethod
    def Event(self) -> type:
        """The event class: ``Event(enable_timing=True)``, ``record()``, ``elapsed_time(end)``."""

    @abc.abstractmethod
    def stream(self, stream: Any) -> Any:
        """Context manager that makes ``stream`` current inside the block."""

    @abc.abstractmethod
    def current_stream(self, device_index: int | None = None) -> Any:
        """The stream work is queued on now."""

    @abc.abstractmethod
    def default_stream(self, device_index: int | None = None) -> Any:
        """The device's default stream."""

    # --- memory ----------------------------------------------------------------------------------

    @abc.abstractmethod
    def empty_cache(self) -> None:
        """Release cached, unused device memory."""

    @abc.abstractmethod
    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes in use by tensors now."""

    @abc.abstractmethod
    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Peak of :meth:`memory_allocated` since the last reset."""

    @abc.abstractmethod
    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        """Restart the peak of :meth:`max_memory_allocated` from now."""

    @abc.abstractmethod
    def memory_reserved(self, device_index: int | None = None) -> int:
        """Bytes held by the allocator (in use or cached)."""

    @abc.abstractmethod
    def max_memory_reserved(self, device_index: int | None = None) -> int:
        """Peak of :meth:`memory_reserved` since the last reset."""

    @abc.abstractmethod
    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        """Allocator statistics, keyed as ``torch.cuda.memory_stats`` (``allocated_bytes.all.current`` ...)."""

    @abc.abstractmethod
    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """Restart every peak statistic from now."""

    @abc.abstractmethod
    def total_memory(self, device_index: int | None = None) -> int:
        """Bytes of memory the device has."""

    @abc.abstractmethod
    def available_memory(self, device_index: int | None = None) -> int:
        """Bytes that can still be allocated."""

    def memory_cached(self, device_index: int | None = None) -> int:
        """Old name of :meth:`memory_reserved`."""
        return self.memory_reserved(device_index)

    def max_memory_cached(self, device_index: int | None = None) -> int:
        """Old name of :meth:`max_memory_reserved`."""
        return self.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        """Old name of :meth:`reset_peak_memory_stats` for the reserved peak."""
        self.reset_peak_memory_stats(device_index)

    # --- data types ------------------------------------------------------------------------------

    @abc.abstractmethod
    def is_bf16_supported(self) -> bool:
        """Whether bfloat16 math runs on this device."""

    @abc.abstractmethod
    def is_fp16_supported(self) -> bool:
        """Whether float16 math runs on this device."""

    def is_fp64_supported(self) -> bool:
        """Whether float64 math runs on this device."""
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        """The floating-point dtypes training may use here."""
        dtypes = [torch.float32]
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        return dtypes

    def _tensor_factory(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        device = self._name

        def make(data: Any = (), **kwargs: Any) -> torch.Tensor:
            return torch.tensor(data, dtype=dtype, device=device, **kwargs)

        make.__name__ = f"{str(dtype).removeprefix('torch.')}_{device}_tensor"
        return make

    @property
    def BFloat16Tensor(self) -> Callable[..., torch.Tensor]:
        """Build a bfloat16 tensor on this device from data: ``BFloat16Tensor([1.0])``."""
        return self._tensor_factory(torch.bfloat16)

    @property
    def ByteTensor(self) -> Callable[..., torch.Tensor]:
        """Build a uint8 tensor on this device from data."""
        return self._tensor_factory(torch.uint8)

    @property
    def DoubleTensor(self) -> Callable[..., torch.Tensor]:
        """Build a float64 tensor on this device from data."""
        return self._tensor_factory(torch.float64)

    @property
    def FloatTensor(self) -> Callable[..., torch.Tensor]:
        """Build a float32 tensor on this device from data."""
        return self._tensor_factory(torch.float32)

    @property
    def HalfTensor(self) -> Callable[..., torch.Tensor]:
        """Build a float16 tensor on this device from data."""
        return self._tensor_factory(torch.float16)

    @property
    def IntTensor(self) -> Callable[..., torch.Tensor]:
        """Build an int32 tensor on this device from data."""
        return self._tensor_factory(torch.int32)

    @property
    def LongTensor(self) -> Callable[..., torch.Tensor]:
        """Build an int64 tensor on this device from data."""
        return self._tensor_factory(torch.int64)

    # --- misc ------------------------------------------------------------------------------------

    @abc.abstractmethod
    def range_push(self, msg: str, domain: str | None = None, category: Any = None) -> Any:
        """Open a named profiler range (NVTX on CUDA, a torch profiler record on CPU)."""

    @abc.abstractmethod
    def range_pop(self, domain: str | None = None) -> Any:
        """Close the innermost range opened by :meth:`range_push`."""

    @abc.abstractmethod
    def amp(self) -> Any:
        """The device's autocast module (``torch.cuda.amp``, ``torch.cpu.amp``)."""

    @abc.abstractmethod
    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        """Run ``callback`` once the device runtime is initialised (now, if it is)."""

    def communication_backend_name(self) -> str:
        """The ``torch.distributed`` backend for this device (``"nccl"``, ``"gloo"``)."""
        return self._communication_backend_name

    @abc.abstractmethod
    def is_triton_supported(self) -> bool:
        """Whether Triton kernels can run on this device."""

    @abc.abstractmethod
    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this device kind."""

    def is_current_stream_capturing(self) -> bool:
        """Whether a graph capture is in progress on the current stream."""
        return False

    def create_graph(self) -> Any:
        """A new device graph for :meth:`capture_to_graph` (CUDA graphs)."""
        raise NotImplementedError(
            f"device graphs are not implemented for the {self._name} accelerator; "
            "disable graph capture (e.g. cuda_graph / graph_harvesting) on this device"
        )

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        """Context manager capturing the block's work into ``graph``."""
        return self.create_graph()

    def replay_graph(self, graph: Any) -> None:
        """Run a captured graph again."""
        self.create_graph()

    # --- pinned host memory ----------------------------------------------------------------------

    def _pins_host_memory(self) -> bool:
        """Whether page-locking host memory means anything here (a device copies from it)."""
        return True

    def pins_host_memory(self) -> bool:
        """Whether ``pin_memory``/``pin_empty`` really page-lock (False on the CPU accelerator,
        where no device copies from host memory): offload buffers ask before pinning."""
        return self._pins_host_memory()

    def pin_memory(
        self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True
    ) -> torch.Tensor:
        """A page-locked copy of host ``tensor`` (fresh uninitialised storage when not ``make_copy``)."""
        if not make_copy:
            shape = tensor.shape if match_shape else (tensor.numel(),)
            return self.pin_empty(shape, dtype=tensor.dtype)
        return tensor.pin_memory() if self._pins_host_memory() else tensor

    def pin_empty(self, *size: Any, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
        """An uninitialised page-locked host tensor of ``size``."""
        if torch.device(device).type != "cpu":
            raise ValueError(f"pin_empty allocates host memory; device must be cpu, got {device!r}")
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], Sequence) else size
        return torch.empty(shape, dtype=dtype, pin_memory=self._pins_host_memory())

    def pin_empty_like(
        self, tensor: torch.Tensor, device: str = "cpu", dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """An uninitialised page-locked host tensor shaped like ``tensor``."""
        return self.pin_empty(tuple(tensor.shape), dtype=dtype or tensor.dtype, device=device)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is page-locked host memory."""
        return tensor.is_pinned() if tensor.is_cpu and self._pins_host_memory() else False

    def unpin_memory(self, tensor: torch.Tensor) -> None:
        """Nothing to undo: torch frees page-locked storage with the tensor."""
        return None

    def pin_memory_alignment(self) -> int:
        """Byte alignment required for registered host memory (1: none)."""
        return 1

    def register_host_memory(self, address: int, num_bytes: int) -> bool:
        """Page-lock existing host memory for the device; False when not supported."""
        return False

    def unregister_host_memory(self, address: int) -> None:
        """Undo :meth:`register_host_memory`."""
        return None

    # --- op builders, launch environment, compile backend ----------------------------------------

    def op_builder_dir(self) -> str:
        """Module whose import registers ds's op builders (see :func:`register_op_builder`)."""
        return _op_builders.OP_BUILDER_MODULE

    def get_op_builder(self, class_name: str) -> type | None:
        """The op builder class named ``class_name`` (e.g. ``"CPUAdamBuilder"``), or None."""
        return _op_builders.lookup(class_name, self._name, self.op_builder_dir())

    def create_op_builder(self, class_name: str) -> Any:
        """An instance of :meth:`get_op_builder`'s class, or None when there is none."""
        builder = self.get_op_builder(class_name)
        return None if builder is None else builder()

    def build_extension(self) -> type:
        """torch's ``BuildExtension`` (setup.py command class for C++/CUDA extensions)."""
        from torch.utils.cpp_extension import BuildExtension

        return BuildExtension

    @abc.abstractmethod
    def export_envs(self) -> list[str]:
        """Prefixes of environment variables a launcher forwards to remote nodes."""

    @abc.abstractmethod
    def visible_devices_envs(self) -> list[str]:
        """Environment variables that restrict the visible devices."""

    def set_visible_devices_envs(
        self, current_env: MutableMapping[str, str], local_accelerator_ids: Sequence[int]
    ) -> None:
        """Restrict ``current_env`` (a launcher's child environment) to ``local_accelerator_ids``."""
        value = ",".join(str(i) for i in local_accelerator_ids)
        for name in self.visible_devices_envs():
            current_env[name] = value

    def get_compile_backend(self) -> str:
        """The ``torch.compile`` backend ds uses (``"inductor"`` unless set)."""
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        """Choose the ``torch.compile`` backend; an unknown name is an error listing the known."""
        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(
                f"set_compile_backend({backend!r}): not a torch.compile backend on "
                f"{self.device_name()}; choose from {sorted(known)}"
            )
        self._compile_backend = backend
