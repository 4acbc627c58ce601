"""Swaps tensors to and from files through a pool of page-locked buffers, double-buffered.

This is what ZeRO-Infinity's NVMe offload needs: ``swap_out(tensors, paths)`` and
``swap_in(tensors, paths)`` (the shape of ds-zero's ``TensorSwapper`` protocol), CPU or CUDA
tensors of any size and dtype.

[Note: staging through the pool]
Each tensor is cut into pieces of the pool's buffer size. ``swap_out`` copies a piece into a free
buffer and starts its write; ``swap_in`` starts the read of a piece into a free buffer and copies
it out when the read completes. When every buffer is busy, the oldest transfer is completed
first, so with two or more buffers the copy of one piece overlaps the disk transfer of the
previous one, and memory stays bounded by the pool whatever the tensors' total size. Because
the pool buffers are page-aligned and page-locked, the disk side is always O_DIRECT in place.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ds_offload_aio._handle import AioHandle
from ds_offload_aio._ops import PendingOp, check_request
from ds_offload_aio._pinned import PinnedBufferPool


@dataclass
class _InFlight:
    op: PendingOp
    buffer: torch.Tensor
    destination: torch.Tensor | None  # the piece of a tensor being swapped in


class AsyncTensorSwapper:
    """Moves whole tensors between memory and one file each, staged through ``pool``.

    The pool must be this swapper's own (its buffers are handed out and reclaimed here).

    Example:
        >>> swapper = AsyncTensorSwapper(AioHandle(intra_op_parallelism=4),
        ...                              PinnedBufferPool(buffer_bytes=64 << 20, count=4))
        >>> swapper.swap_out([exp_avg, exp_avg_sq], ["/nvme/r0/m.swp", "/nvme/r0/v.swp"])
        >>> swapper.swap_in([exp_avg, exp_avg_sq], ["/nvme/r0/m.swp", "/nvme/r0/v.swp"],
        ...                 async_op=True)
        >>> swapper.wait()   # the tensors hold the data now
    """

    def __init__(self, handle: AioHandle, pool: PinnedBufferPool) -> None:
        self._handle = handle
        self._pool = pool
        self._in_flight: deque[_InFlight] = deque()

    @property
    def pinned_bytes(self) -> int:
        """Page-locked host memory this swapper stages through (its pool's buffers)."""
        return self._pool.buffer_bytes * self._pool.count

    def swap_out(
        self,
        tensors: Sequence[torch.Tensor],
        paths: Sequence[str | os.PathLike[str]],
        *,
        async_op: bool = False,
    ) -> None:
        """Writes each tensor to its path (created or overwritten from offset 0).

        The tensors may be changed or freed as soon as this returns, also with ``async_op``
        (their bytes are in the pool by then); with ``async_op`` the last writes may still be in
        flight until ``wait()``.
        """
        for piece, path, offset in self._pieces(tensors, paths, contiguous=False):
            buffer = self._free_buffer()
            staged = buffer[: piece.numel()]
            staged.copy_(piece)
            op = self._handle._submit(check_request(False, staged, path, offset, False, False))
            self._in_flight.append(_InFlight(op, buffer, None))
        if not async_op:
            self.wait()

    def swap_in(
        self,
        tensors: Sequence[torch.Tensor],
        paths: Sequence[str | os.PathLike[str]],
        *,
        async_op: bool = False,
    ) -> None:
        """Reads each path into its (contiguous) tensor.

        With ``async_op`` the first pieces are still loading when this returns; the tensors
        hold the data once ``wait()`` returns.
        """
        for piece, path, offset in self._pieces(tensors, paths, contiguous=True):
            buffer = self._free_buffer()
            staged = buffer[: piece.numel()]
            op = self._handle._submit(check_request(True, staged, path, offset, False, False))
            self._in_flight.append(_InFlight(op, buffer, piece))
        if not async_op:
            self.wait()

    def wait(self) -> int:
        """Completes every transfer in flight; returns how many pieces completed.

        Raises the first failure (an ``AioError`` naming file and offset) after all have ended.
        """
        completed, first_error = 0, None
        while self._in_flight:
            try:
                self._complete_oldest()
                completed += 1
            except BaseException as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return completed

    def _free_buffer(self) -> torch.Tensor:
        while len(self._in_flight) >= self._pool.count:
            self._complete_oldest()
        return self._pool.acquire()

    def _complete_oldest(self) -> None:
        transfer = self._in_flight.popleft()
        try:
            transfer.op.result()
            if transfer.destination is not None:
                transfer.destination.copy_(transfer.buffer[: transfer.destination.numel()])
        finally:
            self._pool.release(transfer.buffer)

    def _pieces(
        self,
        tensors: Sequence[torch.Tensor],
        paths: Sequence[str | os.PathLike[str]],
        *,
        contiguous: bool,
    ) -> Iterator[tuple[torch.Tensor, str | os.PathLike[str], int]]:
        """(uint8 piece of a tensor, its path, its file offset), buffer-sized pieces in order."""
        if len(tensors) != len(paths):
            raise ValueError(f"{len(tensors)} tensors but {len(paths)} paths")
        step = self._pool.buffer_bytes
        for tensor, path in zip(tensors, paths):
            if contiguous and not tensor.is_contiguous():
                raise ValueError("swap_in needs contiguous tensors to read into")
            flat = tensor.contiguous().reshape(-1).view(torch.uint8)
            for offset in range(0, max(flat.numel(), 1), step):
                yield flat[offset : offset + step], path, offset
