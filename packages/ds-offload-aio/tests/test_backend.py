"""Which backend is active, and the thread-pool fallback when the libaio engine is missing."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import ds_offload_aio
from ds_offload_aio import AioFallbackWarning, AioHandle, _ext

Bytes = Callable[..., torch.Tensor]


def test_libaio_engine_is_built() -> None:
    # Every test environment has libaio-dev and a compiler (tools/setup/system-deps.sh):
    # the thread pool here would be a build regression.
    assert ds_offload_aio.backend_info() == {"backend": "libaio", "reason": None}
    with AioHandle() as handle:
        assert handle.backend == "libaio"


def test_missing_engine_falls_back_to_threads_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, random_bytes: Bytes
) -> None:
    reason = "libaio engine not built at install time (CompileError: libaio.h: No such file)"
    monkeypatch.setattr(_ext, "ENGINE", _ext.Engine(unavailable_reason=reason))
    _ext.warn_once.cache_clear()
    assert ds_offload_aio.backend_info() == {"backend": "threads", "reason": reason}

    data = random_bytes(100_003, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            with AioHandle(intra_op_parallelism=2) as handle:
                assert handle.backend == "threads"
                handle.sync_pwrite(data, tmp_path / "d.bin")
                back = torch.empty_like(data)
                handle.sync_pread(back, tmp_path / "d.bin")
                assert torch.equal(back, data)
    (warning,) = [w for w in caught if issubclass(w.category, AioFallbackWarning)]
    assert str(warning.message).startswith(f"ds_offload_aio: {reason}; using the thread-pool")

    with pytest.raises(RuntimeError, match="backend='libaio' is unavailable: libaio engine not"):
        AioHandle(backend="libaio")
