"""The CUDA accelerator: DeepSpeed's ``CUDA_Accelerator`` surface over ``torch.cuda``."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from ds_comm.accelerator._abstract import DeepSpeedAccelerator

__all__ = ["CUDA_Accelerator"]


def _index(device_index: int | None) -> Any:
    """``torch.cuda`` argument for ``device_index`` (None: the current device)."""
    return "cuda" if device_index is None else device_index


class CUDA_Accelerator(DeepSpeedAccelerator):
    """NVIDIA (and ROCm, through torch's CUDA API) GPUs; NCCL for collectives.

    The current device is whatever ``set_device`` chose; ds's ``init_distributed`` selects
    ``cuda:LOCAL_RANK`` when it creates an NCCL group, so :meth:`current_device_name` is
    ``f"cuda:{LOCAL_RANK}"`` after it, as in DeepSpeed.
    """

    supports_nvtx_domain = False

    def __init__(self) -> None:
        super().__init__()
        self._name = "cuda"
        self._communication_backend_name = "nccl" if sys.platform != "win32" else "gloo"
        self._compile_backend = "inductor"

    def is_synchronized_device(self) -> bool:
        return False

    # --- devices ---------------------------------------------------------------------------------

    def device_name(self, device_index: int | str | None = None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cuda") if device_index is None else torch.device("cuda", device_index)

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def communication_backend_version(self) -> tuple[int, ...] | int:
        """NCCL's version as torch reports it."""
        from torch.cuda import nccl

        version: Any = nccl.version()  # (major, minor, patch[, suffix])
        return version

    # --- random number generation ----------------------------------------------------------------

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.cuda.set_rng_state(new_state, _index(device_index))

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state(_index(device_index))

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def default_generator(self, device_index: int | None = None) -> torch.Generator:
        index = torch.cuda.current_device() if device_index is None else device_index
        return torch.cuda.default_generators[index]

    # --- streams and events ----------------------------------------------------------------------

    @property
    def Stream(self) -> type:
        return torch.cuda.Stream

    @property
    def Event(self) -> type:
        return torch.cuda.Event

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None) -> Any:
        return torch.cuda.default_stream(device_index)

    # --- memory ----------------------------------------------------------------------------------

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        return dict(torch.cuda.memory_stats(device_index))

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        index = torch.cuda.current_device() if device_index is None else device_index
        return torch.cuda.get_device_properties(index).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        """Free bytes on the device as the driver reports them (other processes' use counts)."""
        free, _total = torch.cuda.mem_get_info(device_index)
        return free

    # --- data types ------------------------------------------------------------------------------

    def is_bf16_supported(self) -> bool:
        if not torch.cuda.is_available():
            return True  # DeepSpeed's answer when no device can be asked (e.g. building on a login node)
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        if not torch.cuda.is_available():
            return True
        major, _ = torch.cuda.get_device_capability()
        deprecated_ok = os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") == "1"
        return major >= 7 or (major == 6 and deprecated_ok)

    # --- misc ------------------------------------------------------------------------------------

    def range_push(self, msg: str, domain: str | None = None, category: Any = None) -> Any:
        return torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain: str | None = None) -> Any:
        return torch.cuda.nvtx.range_pop()

    def amp(self) -> Any:
        """``torch.cuda.amp`` (``autocast`` and friends for this device)."""
        return torch.cuda.amp

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return torch.cuda._lazy_call(callback)

    def is_triton_supported(self) -> bool:
        if not self.is_available():
            return False
        major, _ = torch.cuda.get_device_capability()
        return major >= 8

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    def is_current_stream_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def create_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        return torch.cuda.graph(graph, pool, stream)

    def replay_graph(self, graph: Any) -> None:
        graph.replay()

    def register_host_memory(self, address: int, num_bytes: int) -> bool:
        cudart: Any = torch.cuda.cudart()
        torch.cuda.check_error(int(cudart.cudaHostRegister(address, num_bytes, 0)))
        return True

    def unregister_host_memory(self, address: int) -> None:
        cudart: Any = torch.cuda.cudart()
        torch.cuda.check_error(int(cudart.cudaHostUnregister(address)))

    def export_envs(self) -> list[str]:
        return ["NCCL"]

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]
