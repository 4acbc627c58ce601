"""The swapper behind ``zero_optimization.offload_optimizer.device = "nvme"``.

[Note: NVMe optimizer offload]
ds-zero keeps each rank's fp32 master partition and gradient in host memory (as with ``cpu``)
and, between steps, writes the optimizer's state tensors to ``<nvme_path>/ds_zero/rank<r>/``
through a ``ds_zero.api.TensorSwapper`` (at stage 3 one master sub-group at a time, the next
one's read overlapping the current one's step: ZeRO-Infinity, docs/zero3.md). The engine builds that swapper from ds-offload-aio: an
``AioHandle`` with the ``aio`` section's settings, staging through a ``PinnedBufferPool`` of
``offload_optimizer.buffer_count`` buffers (at least two, so copies overlap disk transfers),
each as large as one state tensor of this rank's partition, capped at 64 MiB and at least
``aio.block_size``. The state lives in host memory, so GPUDirect Storage (``aio.use_gds``) has
nothing to move and is rejected.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from ds_engine._optional import require
from ds_engine.api import ConfigError, DeepSpeedConfig

__all__ = ["nvme_swapper"]

_MAX_BUFFER_BYTES = 64 << 20


def nvme_swapper(config: DeepSpeedConfig, model: nn.Module) -> Any:
    """ds-offload-aio's ``AsyncTensorSwapper`` for NVMe offload, or None without it (see
    [Note: NVMe optimizer offload])."""
    offload = config.zero_optimization.offload_optimizer
    if offload.device != "nvme":
        return None
    aio = require(
        "ds_offload_aio",
        "ds-offload-aio",
        'zero_optimization.offload_optimizer.device = "nvme" (NVMe offload)',
    )
    settings = config.aio
    if settings.use_gds:
        raise ConfigError(
            "aio.use_gds = true: offload_optimizer keeps optimizer state in host memory, which "
            "GPUDirect Storage cannot move; set aio.use_gds to false"
        )
    # a stage 3 parameter built under zero.Init is empty here: ds_numel is its size
    trainable = sum(
        getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad
    )
    partition = math.ceil(trainable / config.dp_world_size)
    buffer_bytes = max(settings.block_size, min(4 * partition, _MAX_BUFFER_BYTES))
    pool = aio.PinnedBufferPool(buffer_bytes=buffer_bytes, count=max(2, offload.buffer_count))
    return aio.AsyncTensorSwapper(aio.AioHandle.from_config(settings), pool)
