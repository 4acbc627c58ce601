"""1-bit compressed allreduce with error feedback (1-bit Adam, 1-bit LAMB, 0/1 Adam).

[Note: compressed allreduce]
The algorithm of Tang et al. 2021 ("1-bit Adam"), as DeepSpeed's ``runtime/comm/nccl.py`` runs it:
an allreduce split into its two halves, each compressed to one sign bit per element plus one
fp32 scale per chunk, with the compression error of each half fed back into the next call.

The flat tensor (padded to a multiple of ``8 * world_size``) is cut into one chunk per rank; rank
``r`` is the "server" that averages chunk ``r``.

1. Worker: ``c = x + worker_error``; per chunk ``scale = ||c_j||_2 / sqrt(len_j)`` and
   ``q_j = scale_j * sign(c_j)``; ``worker_error = c - q``.
2. ``all_to_all_single``: chunk ``j``'s packed signs and scale go to rank ``j``.
3. Server: ``s = mean_i(q_i) + server_error`` over the ``world_size`` received copies of its chunk;
   compressed again to ``p = scale * sign(s)`` with ``server_error = s - p``.
4. ``all_gather_into_tensor`` of every server's packed ``p``: each rank decompresses the full
   average, so all ranks end with bit-identical results.

Two error buffers because there are two lossy steps: the worker error (full size, one per rank)
remembers what this rank's gradient lost in step 1; the server error (one chunk) remembers what
the average lost in step 3. Because each error is added back next call, the outputs telescope:
``sum_t out_t = sum_t mean(x_t) - mean(worker_error_T) - server_error_T``, so the running mean of
the outputs converges to the true mean at rate ``1/T`` while each step sends ~1/32 of the bytes.

Wire format: a segment per chunk is ``len_chunk / 8`` sign bytes (bit set = non-negative,
most-significant bit first, see ``_bitpack.py``) followed by the 4 bytes of the fp32 scale, so
each half is one collective of ``numel / 8 + 4 * world_size`` bytes. Padding elements are zero,
are excluded from the scales (``len_j`` counts real elements) and never enter an error buffer,
so padding does not change the result.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ds_comm._bitpack import pack_signs, unpack_signs
from ds_comm._collectives import all_gather_into_tensor, all_to_all_single

__all__ = ["CompressedAllReduce", "compressed_all_reduce"]

_SCALE_BYTES = 4  # one fp32 scale per chunk


class CompressedAllReduce:
    """Error-feedback state for averaging a tensor of ``numel`` elements with 1-bit compression.

    Create one per tensor (e.g. per flattened momentum buffer) and keep it across steps: the
    error buffers are what make the compression unbiased over time. See
    [Note: compressed allreduce].

    Args:
        numel: number of elements of the tensors this state reduces.
        group: process group to average over (``None``: the default group).
        device: device of the error buffers and of the tensors passed in (default: torch's
            current default device).

    Attributes:
        worker_error: fp32, ``padded_numel`` elements: what this rank's input lost to compression.
        server_error: fp32, ``chunk_numel`` elements: what this rank's chunk of the average lost.

    Example:
        >>> state = CompressedAllReduce(momentum.numel(), group=dp_group, device="cuda")
        >>> state.compress_all_reduce(momentum)  # averaged in place, ~32x fewer bytes on the wire
    """

    def __init__(
        self,
        numel: int,
        *,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if numel < 1:
            raise ValueError(f"numel must be positive, got {numel}")
        self.numel = numel
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        device = torch.device(device) if device is not None else torch.get_default_device()
        self.chunk_numel = -(-numel // (8 * self.world_size)) * 8
        self.padded_numel = self.chunk_numel * self.world_size
        starts = torch.arange(self.world_size, device=device) * self.chunk_numel
        # Real (unpadded) elements per chunk; a chunk may be empty when numel < padded_numel.
        self._chunk_lengths = (numel - starts).clamp_(0, self.chunk_numel)
        self.worker_error = torch.zeros(self.padded_numel, dtype=torch.float32, device=device)
        self.server_error = torch.zeros(self.chunk_numel, dtype=torch.float32, device=device)

    def reset(self) -> None:
        """Forget accumulated errors (e.g. when the compressed phase restarts)."""
        self.worker_error.zero_()
        self.server_error.zero_()

    def compress_all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Average ``tensor`` over the group in place with 1-bit compression; returns ``tensor``.

        fp16/bf16 inputs are computed in fp32 and the result is cast back on the copy-in.
        """
        if tensor.numel() != self.numel:
            raise ValueError(
                f"state is for {self.numel} elements, got a tensor of {tensor.numel()}"
            )
        if tensor.device != self.worker_error.device:
            raise ValueError(
                f"state lives on {self.worker_error.device}, tensor on {tensor.device}"
            )
        sign_bytes = self.chunk_numel // 8
        with torch.no_grad():
            compensated = self.worker_error  # reused in place: becomes the new worker error below
            compensated[: self.numel].add_(tensor.reshape(-1))
            chunks = compensated.view(self.world_size, self.chunk_numel)
            scales = self._scales(chunks, self._chunk_lengths)
            send = self._encode(chunks, scales)
            chunks.sub_(torch.where(chunks >= 0, scales, -scales))
            compensated[self.numel :].zero_()

            recv = torch.empty_like(send)
            all_to_all_single(recv, send, group=self.group)
            server = self._average_received(recv)
            server.add_(self.server_error)
            length = self._chunk_lengths[self.rank : self.rank + 1]
            scale = self._scales(server.view(1, -1), length).view(())
            mine = self._encode(server.view(1, -1), scale).view(-1)
            self.server_error.copy_(server.sub_(torch.where(server >= 0, scale, -scale)))
            self._zero_padding(self.server_error)

            gathered = torch.empty(
                self.world_size * (sign_bytes + _SCALE_BYTES),
                dtype=torch.uint8,
                device=tensor.device,
            )
            all_gather_into_tensor(gathered, mine, group=self.group)
            signs, scales = self._decode(gathered.view(self.world_size, -1))
            result = signs.mul_(scales).view(-1)[: self.numel]
            tensor.copy_(result.view(tensor.shape))
        return tensor

    @staticmethod
    def _scales(chunks: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        # ||c||_2 / sqrt(len): the scale that preserves the chunk's norm (DeepSpeed's convention).
        norms = torch.linalg.vector_norm(chunks, dim=1, keepdim=True)
        return norms / lengths.clamp(min=1).to(norms.dtype).sqrt().view(-1, 1)

    @staticmethod
    def _encode(chunks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        rows, numel = chunks.shape
        out = torch.empty(rows, numel // 8 + _SCALE_BYTES, dtype=torch.uint8, device=chunks.device)
        out[:, : numel // 8] = pack_signs(chunks).view(rows, -1)
        out[:, numel // 8 :] = scales.reshape(rows, 1).view(torch.uint8)
        return out

    def _decode(self, segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sign_bytes = self.chunk_numel // 8
        signs = unpack_signs(segments[:, :sign_bytes]).view(segments.shape[0], self.chunk_numel)
        # A fresh buffer: viewing bytes as fp32 needs a 4-byte-aligned storage offset.
        scale_bytes = torch.empty(
            segments.shape[0], _SCALE_BYTES, dtype=torch.uint8, device=segments.device
        )
        scales = scale_bytes.copy_(segments[:, sign_bytes:]).view(torch.float32)
        return signs, scales

    def _average_received(self, recv: torch.Tensor) -> torch.Tensor:
        signs, scales = self._decode(recv.view(self.world_size, -1))
        server = (scales.view(1, -1) @ signs).view(-1).div_(self.world_size)
        self._zero_padding(server)
        return server

    def _zero_padding(self, chunk: torch.Tensor) -> None:
        start = self.rank * self.chunk_numel
        valid = min(max(self.numel - start, 0), self.chunk_numel)
        chunk[valid:].zero_()


def compressed_all_reduce(tensor: torch.Tensor, state: CompressedAllReduce) -> torch.Tensor:
    """Average ``tensor`` in place over ``state.group`` with 1-bit compression and error feedback.

    Functional form of :meth:`CompressedAllReduce.compress_all_reduce`; ``state`` carries the
    error buffers between calls and must be reused for the same tensor every step.

    Example:
        >>> state = CompressedAllReduce(grad.numel(), group=dp_group)
        >>> for step in range(steps):
        ...     compressed_all_reduce(grad, state)
    """
    return state.compress_all_reduce(tensor)
