"""ZeRO-Offload: host placement of partitions and NVMe swapping of optimizer state.

[Note: ZeRO-Offload]
With ``offload_optimizer.device`` cpu or nvme, each rank's fp32 master partition, its fp32
gradient partition and the optimizer state live in host memory (page-locked with
``pin_memory`` when the accelerator copies from host memory), and the optimizer steps there: ds-optim's ``CPUAdam``
(DeepSpeed's ``DeepSpeedCPUAdam``) is the fast choice, and any ``torch.optim`` optimizer works.
Reduced gradient shards are copied device-to-host as they land; after the step the updated
partition is copied back in the model's dtype (by ``CPUAdam`` itself when it accepts
``fp16_param_groups``) and gathered. With nvme, the optimizer state tensors are additionally
written out through a :class:`~ds_zero.api.TensorSwapper` after every step and read back before
the next, so between steps they occupy no memory. The swapper is ds-offload-aio's
``AsyncTensorSwapper`` (built with DeepSpeed's default ``aio`` settings when none is passed), or
anything satisfying :class:`~ds_zero.api.TensorSwapper`; files go under
``<nvme_path>/ds_zero/rank<r>/``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from ds_comm.accelerator import get_accelerator
from ds_zero.api import ConfigError, TensorSwapper

__all__ = ["StateSwap", "accepts_fp16_param_groups", "default_swapper", "host_zeros"]


def host_zeros(numel: int, dtype: torch.dtype, *, pin_memory: bool) -> torch.Tensor:
    """A zeroed host tensor, page-locked (through the accelerator) when asked and a device
    copies from host memory."""
    accelerator = get_accelerator()
    if pin_memory and accelerator.pins_host_memory():
        return accelerator.pin_empty(numel, dtype=dtype).zero_()
    return torch.zeros(numel, dtype=dtype, device="cpu")


UPLOAD_CHUNK_NUMEL = 1 << 24  # 64 MiB of fp32 on the device at a time


def upload_cast(
    host: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device,
    chunk_numel: int = UPLOAD_CHUNK_NUMEL,
) -> torch.Tensor:
    """``host.to(device=device, dtype=dtype)`` through one reused device chunk.

    ``Tensor.to`` with both a device and a dtype copies the whole tensor to the device in its
    own dtype first: an offloaded step would hold a full fp32 copy of the master partition on
    the device for a moment (4 bytes per parameter at the memory peak). Chunk by chunk, that
    moment holds ``chunk_numel`` elements; the bytes that cross the bus and the cast on the
    device are the same. Everything runs on the current stream, so the chunk buffer's reuse is
    ordered after the cast that read it.
    """
    flat = host.reshape(-1)
    if flat.device.type == torch.device(device).type or flat.numel() <= chunk_numel:
        return flat.to(device=device, dtype=dtype, non_blocking=True)
    out = torch.empty(flat.numel(), dtype=dtype, device=device)
    chunk = torch.empty(chunk_numel, dtype=flat.dtype, device=device)
    for start in range(0, flat.numel(), chunk_numel):
        length = min(chunk_numel, flat.numel() - start)
        piece = chunk.narrow(0, 0, length)
        piece.copy_(flat.narrow(0, start, length), non_blocking=True)
        out.narrow(0, start, length).copy_(piece)
    return out


def accepts_fp16_param_groups(optimizer: torch.optim.Optimizer) -> bool:
    """True for optimizers whose ``step`` also writes low-precision copies (``CPUAdam``)."""
    try:
        return "fp16_param_groups" in inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):
        return False


def default_swapper(buffer_bytes: int, buffer_count: int) -> TensorSwapper:
    """ds-offload-aio's swapper with DeepSpeed's default ``aio`` settings.

    Raises:
        ConfigError: ds-offload-aio is not installed.
    """
    try:
        import ds_offload_aio as aio
    except ImportError as exc:
        raise ConfigError(
            'zero_optimization.offload_optimizer.device = "nvme" swaps through ds-offload-aio, '
            "which is not installed: pip install ds-zero[nvme] (or pass swapper=)"
        ) from exc
    pool = aio.PinnedBufferPool(buffer_bytes=buffer_bytes, count=max(2, buffer_count))
    return aio.AsyncTensorSwapper(aio.AioHandle(), pool)


class StateSwap:
    """Swaps an optimizer's partition-sized state tensors out after a step and in before the next.

    Every method takes the indices of the masters to move (None: all of them), so stage 3 can
    keep one sub-group's state in memory at a time and read the next one's while stepping the
    current one (see ``_shard_layout.py``'s [Note: ZeRO-Infinity sub-group pipeline]).

    Args:
        swapper: the NVMe swapper.
        optimizer: the optimizer whose ``state`` holds partition-sized tensors.
        masters: the tensors the optimizer steps (one per group or sub-group).
        folder: this rank's directory for the swap files (created).
    """

    def __init__(
        self,
        swapper: TensorSwapper,
        optimizer: torch.optim.Optimizer,
        masters: Sequence[torch.Tensor],
        folder: Path,
    ) -> None:
        self.swapper, self.optimizer, self.masters = swapper, optimizer, masters
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._out: dict[tuple[int, str], tuple[torch.Size, torch.dtype]] = {}
        self._reading: dict[tuple[int, str], torch.Tensor] = {}  # started, not installed yet
        self.reads = self.writes = 0  # state tensors read from / written to files

    def _path(self, index: int, name: str) -> str:
        return str(self.folder / f"group{index}_{name}.swp")

    def _indices(self, indices: Iterable[int] | None) -> list[int]:
        return list(range(len(self.masters))) if indices is None else list(indices)

    @property
    def pinned_bytes(self) -> int:
        """Page-locked staging memory of the swapper (0 when it does not say)."""
        return int(getattr(self.swapper, "pinned_bytes", 0) or 0)

    def swap_out(self, indices: Iterable[int] | None = None, *, async_op: bool = False) -> None:
        """Write the partition-sized state tensors of ``indices`` out and drop them from the
        optimizer (with ``async_op`` the last writes may be in flight until :meth:`wait`; the
        tensors are staged already, so they are freed here either way)."""
        moved, tensors = [], []
        for index in self._indices(indices):
            master = self.masters[index]
            for name, value in self.optimizer.state.get(master, {}).items():
                if isinstance(value, torch.Tensor) and value.numel() == master.numel():
                    moved.append((index, name))
                    tensors.append(value)
        if not moved:
            return
        self.swapper.swap_out(tensors, [self._path(i, n) for i, n in moved], async_op=async_op)
        self.writes += len(moved)
        for (index, name), tensor in zip(moved, tensors):
            self._out[index, name] = (tensor.shape, tensor.dtype)
            del self.optimizer.state[self.masters[index]][name]

    def swap_in(self, indices: Iterable[int] | None = None, *, async_op: bool = False) -> None:
        """Read the swapped-out tensors of ``indices`` back into the optimizer's state; with
        ``async_op`` the reads are only started, and :meth:`wait` installs them."""
        wanted = set(self._indices(indices))
        keys = [k for k in self._out if k[0] in wanted and k not in self._reading]
        if keys:
            tensors = []
            for key in keys:
                shape, dtype = self._out[key]
                tensor = torch.empty(shape, dtype=dtype, device=self.masters[key[0]].device)
                self._reading[key] = tensor
                tensors.append(tensor)
            self.swapper.swap_in(tensors, [self._path(i, n) for i, n in keys], async_op=True)
            self.reads += len(keys)
        if not async_op:
            self.wait()

    def wait(self) -> None:
        """Complete every transfer in flight and install the tensors read."""
        self.swapper.wait()
        for (index, name), tensor in self._reading.items():
            self.optimizer.state[self.masters[index]][name] = tensor
            del self._out[index, name]
        self._reading.clear()
