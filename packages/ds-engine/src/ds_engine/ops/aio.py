"""``deepspeed.ops.aio``: async tensor file I/O from ds-offload-aio under DeepSpeed's names.

``AsyncIOBuilder().load().aio_handle(...)`` (DeepSpeed's idiom) and ``aio_handle(...)`` give the
same handle: ``ds_offload_aio.AioHandle`` (libaio, else a thread pool).
"""

from __future__ import annotations

from ds_engine.ops.op_builder import AsyncIOBuilder
from ds_offload_aio import AioHandle, GdsHandle, aio_handle

__all__ = ["AioHandle", "AsyncIOBuilder", "GdsHandle", "aio_handle"]
