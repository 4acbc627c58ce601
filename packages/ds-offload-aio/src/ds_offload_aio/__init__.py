"""ds-offload-aio: async tensor file I/O at the speed of the disk (DeepSpeed's DeepNVMe).

``AioHandle`` (alias ``aio_handle``) reads and writes tensors with Linux AIO and O_DIRECT through
a C engine built at install time, or a thread pool of ``os.preadv``/``os.pwritev`` where libaio
is missing (``backend_info()`` says which). ``AsyncTensorSwapper`` and ``PinnedBufferPool`` are
what ZeRO-Infinity's NVMe offload uses; ``ds-nvme-tune`` (``tune``) finds the best ``aio`` section.
"""

from __future__ import annotations

from ds_offload_aio._ext import backend_info
from ds_offload_aio._gds import GdsHandle
from ds_offload_aio._handle import AioHandle, aio_handle
from ds_offload_aio._pinned import PinnedBufferPool
from ds_offload_aio._swapper import AsyncTensorSwapper
from ds_offload_aio._tune import TuneResult, tune
from ds_offload_aio.api import (
    ALIGNMENT,
    AioConfig,
    AioError,
    AioFallbackWarning,
    Backend,
    BackendInfo,
    ConfigError,
    GdsUnavailableError,
)

__version__ = "0.2.0"

__all__ = [
    # handles
    "AioHandle",
    "aio_handle",
    "GdsHandle",
    "backend_info",
    # swapping
    "AsyncTensorSwapper",
    "PinnedBufferPool",
    # tuning
    "tune",
    "TuneResult",
    # config and types
    "AioConfig",
    "ALIGNMENT",
    "Backend",
    "BackendInfo",
    # errors and warnings
    "AioError",
    "AioFallbackWarning",
    "ConfigError",
    "GdsUnavailableError",
    "__version__",
]
