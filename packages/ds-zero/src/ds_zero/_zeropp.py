"""ZeRO++ at stage 3: quantized weight all-gathers (qwZ), quantized gradient reduction (qgZ) and
a secondary, node-local partition of the weights (hpZ).

[Note: ZeRO++]
All three change only how stage 3's collectives move data; the partition, the fp32 masters and
the step are those of plain ZeRO-3 (``_shard_layout.py``).

- **qwZ** (``zero_quantized_weights``): the parameter all-gathers of the forward and backward
  hooks (``_stage3.py``) send each rank's shards as int8 codes with one float32 scale per block
  (``ds_kernels.quantize_blockwise``; the blocks are 256 elements, fewer for a shard of fewer
  elements, and never span two parameters), packed into one byte buffer, so one all-gather moves
  about a quarter of the fp32 bytes. Every rank dequantizes every rank's shards, its own
  included, so all ranks compute with the same weights, and the backward's re-gather gives the
  forward's values again (a shard quantizes to the same codes whichever parameters share its
  collective). Other gathers (``GatheredParameters``, the persistent
  parameters refreshed after a step, checkpoints) stay exact, as in DeepSpeed.
- **qgZ** (``zero_quantized_gradients``): a gradient bucket of rows ``[rank r's shard of each
  parameter]`` is quantized row by row (int8 codes, one scale per block) and sent by one
  all-to-all, row ``r`` to rank ``r``; each rank dequantizes the rows it received and sums them
  in fp32. DeepSpeed's qgZ is the same all-to-all reduction (in two hops across nodes, int4 on
  the wire); this one is one hop over the data-parallel group with int8 codes, which keeps the
  error of a summed gradient within one code step per rank and still sends about a quarter of
  the reduce-scatter's fp32 bytes.
- **hpZ** (``zero_hpz_partition_size = h``): the data-parallel ranks are cut into groups of
  ``h`` consecutive ranks (a node). When a forward gather completes, each rank keeps the
  ``r``-th ``1/h`` slice of each whole (padded) parameter, ``r`` its place in its group
  (``p.ds_secondary_tensor``, DeepSpeed's name). A backward gather of parameters that all have
  one all-gathers those slices within the group instead of the shards over all ranks: the same
  values (the forward's, quantized or not), over the fast links only. The slices are dropped
  when the shards change (the optimizer's step, a checkpoint load, ``GatheredParameters`` with a
  modifier), so the next forward gathers the new values over all ranks again. They cost
  ``numel / h`` elements per parameter from its forward to the next step.
"""

# DeepSpeed's ZeRO-3 parameter attributes (p.ds_id, p.ds_tensor, p.ds_status, ...) are set on
# torch Parameters at run time, which the type checker cannot see.
# pyright: reportAttributeAccessIssue=false

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

import ds_comm
from ds_kernels import dequantize_blockwise, quantize_blockwise
from ds_zero.api import ZeroConfig

__all__ = [
    "WeightComm",
    "build_weight_comm",
    "hpz_subgroup",
    "quantized_reduce_scatter",
]

_BLOCK = 256  # elements per scale (fewer when a collective has fewer elements)
Decode = Callable[[torch.Tensor], torch.Tensor]


def block_size(numel: int) -> int:
    """Elements per scale for a quantized collective of ``numel`` elements per rank: 256, or the
    smallest power of two holding them all (a small gather pads less)."""
    size = 2
    while size < min(numel, _BLOCK):
        size *= 2
    return size


def _pack(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, int]:
    """``x`` (rows ``(n, m)``, ``m`` a multiple of ``block``) as bytes ``(n, codes + scales)``,
    and the number of code bytes per row."""
    rows = x.shape[0]
    q, scales = quantize_blockwise(x.reshape(-1), bits=bits, block_size=block)
    codes = q.view(torch.uint8).view(rows, -1)
    return torch.cat((codes, scales.view(rows, -1).view(torch.uint8)), dim=1), codes.shape[1]


def _unpack_rows(
    packed: torch.Tensor, code_bytes: int, bits: int, block: int, dtype: torch.dtype
) -> torch.Tensor:
    """Dequantize every row of :func:`_pack`'s bytes into ``(n, m)`` values of ``dtype``."""
    rows = packed.shape[0]
    codes = packed[:, :code_bytes].contiguous().view(-1)
    if bits == 8:
        codes = codes.view(torch.int8)
    scales = packed[:, code_bytes:].contiguous().view(torch.float32).view(-1)
    values = dequantize_blockwise(codes, scales, bits=bits, block_size=block, dtype=dtype)
    return values.view(rows, -1)


def _padded_rows(rows: torch.Tensor, block: int) -> torch.Tensor:
    """``rows`` with zero columns appended up to a multiple of ``block``."""
    cols = rows.shape[1]
    width = -(-cols // block) * block
    if width == cols:
        return rows
    out = torch.zeros(rows.shape[0], width, dtype=rows.dtype, device=rows.device)
    out[:, :cols].copy_(rows)
    return out


def _quantize_shards(
    flat: torch.Tensor, widths: Sequence[int], world: int
) -> tuple[torch.Tensor, Decode]:
    """qwZ's payload of this rank's concatenated shards (widths ``widths``): each shard quantized
    on its own (int8, blocks of :func:`block_size` of its width, never spanning two shards, so
    a parameter's gathered value does not depend on which others share its collective), the
    shards of one block size in one call; and the decoder of the gathered payloads into a plain
    gather's ``world x sum(widths)`` rows."""
    by_block: dict[int, list[int]] = {}
    for index, width in enumerate(widths):
        by_block.setdefault(block_size(width), []).append(index)
    starts = [0]
    for width in widths:
        starts.append(starts[-1] + width)
    parts, layout = [], []
    for block, indices in sorted(by_block.items(), reverse=True):
        shards = [flat[starts[i] : starts[i + 1]].view(1, -1) for i in indices]
        padded = torch.cat([_padded_rows(shard, block) for shard in shards], dim=1)
        packed, code_bytes = _pack(padded, 8, block)
        parts.append(packed.view(-1))
        layout.append((block, indices, packed.numel(), code_bytes))
    dtype = flat.dtype

    def decode(raw: torch.Tensor) -> torch.Tensor:
        rows = raw.view(world, -1)
        columns: list[torch.Tensor | None] = [None] * len(widths)
        offset = 0
        for block, indices, nbytes, code_bytes in layout:
            values = _unpack_rows(rows[:, offset : offset + nbytes], code_bytes, 8, block, dtype)
            offset += nbytes
            column = 0
            for i in indices:
                columns[i] = values[:, column : column + widths[i]]
                column += -(-widths[i] // block) * block
        return torch.cat([c for c in columns if c is not None], dim=1).view(-1)

    payload = parts[0] if len(parts) == 1 else torch.cat(parts)
    return payload, decode


class _Reduced:
    """The pending all-to-all of :func:`quantized_reduce_scatter`; ``wait()`` lands the sum."""

    def __init__(self, work: Any, finish: Callable[[], None]) -> None:
        self._work, self._finish = work, finish

    def wait(self) -> bool:
        if self._finish is not None:
            if self._work is not None:
                self._work.wait()
            self._finish()
            self._work = self._finish = None  # type: ignore[assignment]
        return True


def quantized_reduce_scatter(
    out: torch.Tensor,
    send: torch.Tensor,
    *,
    group: Any = None,
    async_op: bool = False,
    bits: int = 8,
) -> _Reduced:
    """qgZ: ``out`` becomes the sum over ranks of their ``send`` row ``rank``, moved as one
    all-to-all of blockwise-quantized rows (see [Note: ZeRO++]); ``reduce_scatter_tensor``'s
    contract (``send`` holds ``world`` rows of ``out.numel()`` elements).

    Returns:
        A handle whose ``wait()`` completes the all-to-all and writes ``out`` (done already
        unless ``async_op``).
    """
    cols = out.numel()
    world = send.numel() // cols
    block = block_size(cols)
    rows = _padded_rows(send.view(world, cols).float(), block)
    payload, code_bytes = _pack(rows, bits, block)
    received = torch.empty_like(payload)
    work = ds_comm.all_to_all_single(received, payload, group=group, async_op=async_op)

    def finish() -> None:
        values = _unpack_rows(received, code_bytes, bits, block, torch.float32)
        out.copy_(values[:, :cols].sum(dim=0))

    handle = _Reduced(work, finish)
    if not async_op:
        handle.wait()
    return handle


def hpz_subgroup(group: Any, size: int) -> tuple[Any, int]:
    """This rank's hpZ group: ``size`` consecutive ranks of the data-parallel ``group``, and its
    place in it. Every rank of ``group`` calls it (it creates every subgroup)."""
    ranks = ds_comm.get_all_ranks_from_group(group)
    if len(ranks) % size:
        raise ValueError(
            f"zero_optimization.zero_hpz_partition_size = {size} does not divide the "
            f"data-parallel size {len(ranks)}; use a divisor of it (the ranks of a node)"
        )
    me = dist.get_rank()
    mine: Any = None
    local = len(ranks) != dist.get_world_size()  # a data-parallel group of part of the world
    for start in range(0, len(ranks), size):
        members = ranks[start : start + size]
        if local and me not in members:
            continue  # with local synchronisation only the members create a group
        made = dist.new_group(ranks=members, use_local_synchronization=local)
        if me in members:
            mine = made
    return mine, ranks.index(me) % size


class WeightComm:
    """How the stage 3 hooks' gathers move parameters under qwZ and hpZ (see [Note: ZeRO++]).

    Args:
        group: the data-parallel group; ``world_size`` its size.
        quantize: qwZ: all-gather int8 codes and scales.
        hpz_group: hpZ's group of this rank (None: no secondary partition); ``hpz_size`` its
            size and ``hpz_rank`` this rank's place in it.
    """

    def __init__(
        self,
        group: Any,
        world_size: int,
        *,
        quantize: bool,
        hpz_group: Any = None,
        hpz_size: int = 1,
        hpz_rank: int = 0,
    ) -> None:
        self.group, self.world_size, self.quantize = group, world_size, quantize
        self.hpz_group = hpz_group if hpz_size > 1 else None
        self.hpz_size, self.hpz_rank = hpz_size, hpz_rank

    def issue(
        self,
        params: Sequence[torch.nn.Parameter],
        shards: Callable[[], torch.Tensor],
        *,
        backward: bool,
        device: torch.device,
    ) -> tuple[Any, torch.Tensor, Decode | None]:
        """Start the all-gather of ``params``: ``(work, raw output, decode)``, where ``decode``
        turns the raw output into the ``world x sum(shard sizes)`` rows of a plain gather.

        Args:
            params: the parameters (not gathered, all non-persistent or all persistent).
            shards: builds this rank's shards of them, concatenated, on ``device``.
            backward: a backward gather: from the secondary partition when all have one.
        """
        if backward and self.hpz_group is not None and all(_has_secondary(p) for p in params):
            return self._from_secondary(params, device)
        flat = shards()
        if not self.quantize:
            output = torch.empty(self.world_size * flat.numel(), dtype=flat.dtype, device=device)
            work = ds_comm.all_gather_into_tensor(output, flat, group=self.group, async_op=True)
            return work, output, None
        widths = [p.ds_tensor.numel() for p in params]
        payload, decode = _quantize_shards(flat, widths, self.world_size)
        output = torch.empty(self.world_size * payload.numel(), dtype=torch.uint8, device=device)
        work = ds_comm.all_gather_into_tensor(output, payload, group=self.group, async_op=True)
        return work, output, decode

    def _from_secondary(
        self, params: Sequence[torch.nn.Parameter], device: torch.device
    ) -> tuple[Any, torch.Tensor, Decode]:
        """All-gather the secondary slices within the hpZ group."""
        pieces = [p.ds_secondary_tensor.to(device, non_blocking=True) for p in params]
        flat = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        h, world = self.hpz_size, self.world_size
        output = torch.empty(h * flat.numel(), dtype=flat.dtype, device=device)
        work = ds_comm.all_gather_into_tensor(output, flat, group=self.hpz_group, async_op=True)
        widths = [p.ds_tensor.numel() for p in params]

        def decode(raw: torch.Tensor) -> torch.Tensor:
            # row j of the hpZ gather holds primary rows j*k .. j*k+k-1 (k = world / h)
            rows = raw.view(h, -1)
            columns, offset = [], 0
            for s in widths:
                secondary = s * world // h
                columns.append(rows[:, offset : offset + secondary].reshape(world, s))
                offset += secondary
            return torch.cat(columns, dim=1).view(-1)

        return work, output, decode

    def keep_secondary(self, params: Sequence[torch.nn.Parameter]) -> None:
        """After a forward gather: keep this rank's ``1/h`` slice of each whole parameter."""
        if self.hpz_group is None:
            return
        for p in params:
            buffer = getattr(p, "_ds_buffer", None)
            if p.ds_persist or buffer is None:
                continue
            size = buffer.numel() // self.hpz_size
            p.ds_secondary_tensor = buffer.narrow(0, self.hpz_rank * size, size).clone()

    @staticmethod
    def drop_secondary(params: Sequence[torch.nn.Parameter]) -> None:
        """Forget the secondary slices (the shards changed)."""
        for p in params:
            if getattr(p, "ds_secondary_tensor", None) is not None:
                p.ds_secondary_tensor = None


def _has_secondary(p: torch.nn.Parameter) -> bool:
    return getattr(p, "ds_secondary_tensor", None) is not None


def build_weight_comm(config: ZeroConfig, group: Any, world_size: int) -> WeightComm | None:
    """The qwZ/hpZ gather of ``config`` over the data-parallel ``group`` (None: neither is on
    or there is one rank). A collective with hpZ (it creates the subgroups)."""
    hpz = config.zero_hpz_partition_size
    if world_size == 1 or (not config.zero_quantized_weights and hpz == 1):
        return None
    hpz_group, hpz_rank = hpz_subgroup(group, hpz) if hpz > 1 else (None, 0)
    return WeightComm(
        group,
        world_size,
        quantize=config.zero_quantized_weights,
        hpz_group=hpz_group,
        hpz_size=hpz,
        hpz_rank=hpz_rank,
    )
