"""``GdsHandle``: GPUDirect Storage through kvikio (cuFile) when it is installed.

GDS itself is out of scope for this package: without kvikio the constructor raises
``GdsUnavailableError`` and ``AioHandle`` (pinned bounce buffers) is the way to move CUDA tensors.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

from ds_offload_aio import _ops
from ds_offload_aio._handle import IoHandleBase
from ds_offload_aio.api import AioError, GdsUnavailableError


def _import_kvikio() -> Any:
    try:
        return importlib.import_module("kvikio")
    except ImportError as exc:
        raise GdsUnavailableError(
            f"GPUDirect Storage is not available: kvikio (cuFile) cannot be imported ({exc}). "
            "Use AioHandle, which moves CUDA tensors through pinned bounce buffers, or install "
            "kvikio (e.g. `pip install kvikio-cu12`) on a machine with GDS."
        ) from None


class _GdsOp:
    """One kvikio read or write in flight."""

    def __init__(self, kvikio: Any, request: _ops.OpRequest) -> None:
        self._request = request
        if not request.is_read and not os.path.exists(request.path):
            os.close(os.open(request.path, os.O_WRONLY | os.O_CREAT, 0o644))  # "r+" needs it
        self._file = kvikio.CuFile(request.path, "r" if request.is_read else "r+")
        method = self._file.pread if request.is_read else self._file.pwrite
        self._future = method(request.tensor, request.nbytes, request.offset)

    def result(self) -> None:
        request = self._request
        kind = "read" if request.is_read else "write"
        try:
            moved = self._future.get()
        except RuntimeError as exc:
            raise AioError(None, str(exc), request.path, offset=request.offset, op=kind) from exc
        finally:
            self._file.close()
        if moved != request.nbytes:
            raise AioError(
                None,
                f"short {kind}: {moved} of {request.nbytes} bytes",
                request.path,
                offset=request.offset + moved,
                op=kind,
            )


class GdsHandle(IoHandleBase):
    """DeepSpeed's ``gds_handle``: the ``AioHandle`` verbs, moving CUDA tensors with cuFile.

    Raises:
        GdsUnavailableError: kvikio is not importable (GDS is not set up on this machine).
    """

    def __init__(
        self,
        block_size: int = 1048576,
        queue_depth: int = 128,
        single_submit: bool = False,
        overlap_events: bool = False,
        intra_op_parallelism: int = 1,
    ) -> None:
        self._kvikio = _import_kvikio()
        super().__init__(
            block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism
        )

    def _submit(self, request: _ops.OpRequest) -> _GdsOp:
        if request.atomic or request.validate:
            raise ValueError("GdsHandle supports neither atomic=True nor validate=True")
        return _GdsOp(self._kvikio, request)

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty(num_elem, dtype=example_tensor.dtype, pin_memory=True)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()
