"""GdsHandle: GPUDirect Storage is optional and says so clearly when it is missing."""

from __future__ import annotations

import importlib.util

import pytest

from ds_offload_aio import GdsHandle, GdsUnavailableError


@pytest.mark.skipif(importlib.util.find_spec("kvikio") is not None, reason="kvikio is installed")
def test_gds_handle_without_kvikio_says_gds_is_unavailable() -> None:
    with pytest.raises(GdsUnavailableError) as info:
        GdsHandle()
    message = str(info.value)
    assert message.startswith("GPUDirect Storage is not available: kvikio (cuFile)")
    assert "Use AioHandle" in message
