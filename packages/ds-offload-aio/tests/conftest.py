"""Shared fixtures: seeded random bytes, a plain look at a file's bytes, the backend matrix."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch


def _random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def _file_bytes(path: str | os.PathLike[str], offset: int, nbytes: int) -> torch.Tensor:
    with open(path, "rb") as f:
        f.seek(offset)
        data = bytearray(f.read(nbytes))
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


@pytest.fixture
def random_bytes() -> Callable[[int, int], torch.Tensor]:
    """``random_bytes(nbytes, seed)``: a uint8 tensor of seeded random bytes."""
    return _random_bytes


@pytest.fixture
def file_bytes() -> Callable[[str | os.PathLike[str], int, int], torch.Tensor]:
    """``file_bytes(path, offset, nbytes)``: the file's bytes read with plain buffered I/O."""
    return _file_bytes


@pytest.fixture(params=["libaio", "threads"])
def backend(request: pytest.FixtureRequest) -> str:
    """Both ways of moving bytes: the C engine and the thread-pool fallback."""
    return request.param
