"""Round trips keep every byte: any size, offset, dtype and memory kind, on both backends."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ds_offload_aio import AioHandle

Bytes = Callable[..., torch.Tensor]

SIZES = [1, 511, 4095, 4096, 4097, 65536 + 3, (1 << 20) + 4097]
OFFSETS = [0, 1, 4096, 12345]


def _buffer(kind: str, nbytes: int, handle: AioHandle) -> torch.Tensor:
    if kind == "locked":  # page-aligned: moved in place
        return handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    if kind == "misaligned":  # one byte past an allocation: goes through the bounce buffers
        return torch.empty(nbytes + 1, dtype=torch.uint8)[1:]
    return torch.empty(nbytes, dtype=torch.uint8)


@pytest.mark.parametrize("memory", ["pageable", "locked", "misaligned"])
def test_round_trip_any_size_and_offset(
    tmp_path: Path, backend: str, memory: str, random_bytes: Bytes, file_bytes: Bytes
) -> None:
    path = tmp_path / "data.bin"
    # Small blocks and a short queue: many requests per slice; 3 threads: uneven slices.
    with AioHandle(65536, 4, intra_op_parallelism=3, backend=backend) as handle:  # type: ignore[arg-type]
        for seed, (nbytes, offset) in enumerate((n, o) for n in SIZES for o in OFFSETS):
            data = random_bytes(nbytes, seed)
            source = _buffer(memory, nbytes, handle)
            source.copy_(data)
            assert handle.sync_pwrite(source, path, offset=offset) == 1
            assert torch.equal(file_bytes(path, offset, nbytes), data), (nbytes, offset)

            target = _buffer(memory, nbytes, handle)
            target.zero_()
            assert handle.sync_pread(target, path, offset=offset) == 1
            assert torch.equal(target, data), (nbytes, offset)


def test_unaligned_write_leaves_neighbouring_bytes_alone(
    tmp_path: Path, backend: str, random_bytes: Bytes, file_bytes: Bytes
) -> None:
    path = tmp_path / "data.bin"
    background = random_bytes(3 * 65536, seed=1)
    patch = random_bytes(70001, seed=2)
    with AioHandle(8192, 8, intra_op_parallelism=2, backend=backend) as handle:  # type: ignore[arg-type]
        handle.sync_pwrite(background, path)
        handle.sync_pwrite(patch, path, offset=4099)

    expected = background.clone()
    expected[4099 : 4099 + patch.numel()] = patch
    assert os.path.getsize(path) == background.numel()
    assert torch.equal(file_bytes(path, 0, background.numel()), expected)


def test_sparse_file_at_a_three_gib_offset(
    tmp_path: Path, backend: str, random_bytes: Bytes
) -> None:
    path = tmp_path / "sparse.bin"
    offset = 3 * (1 << 30) + 12345
    data = random_bytes((1 << 20) + 7, seed=3)
    with AioHandle(backend=backend) as handle:  # type: ignore[arg-type]
        handle.sync_pwrite(data, path, offset=offset)
        back = torch.empty_like(data)
        handle.sync_pread(back, path, offset=offset)
        hole = torch.full((4097,), 0xFF, dtype=torch.uint8)
        handle.sync_pread(hole, path, offset=1 << 30)

    assert torch.equal(back, data)
    assert torch.count_nonzero(hole) == 0  # a hole reads as zeros
    assert os.path.getsize(path) == offset + data.numel()
    assert os.stat(path).st_blocks * 512 < 64 << 20  # still sparse: nothing written before


def _dtypes() -> list[torch.dtype]:
    names = sorted(n for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype))
    # Quantized tensors carry scale/zero-point outside their storage: not plain bytes.
    return sorted({getattr(torch, n) for n in names if not n.startswith(("q", "quint"))}, key=str)


@pytest.mark.parametrize("dtype", _dtypes(), ids=str)
@pytest.mark.filterwarnings("ignore:.*support is experimental")
def test_every_dtype_round_trips(tmp_path: Path, dtype: torch.dtype, random_bytes: Bytes) -> None:
    path = tmp_path / "t.bin"
    with AioHandle(intra_op_parallelism=2) as handle:
        for shape, seed in (((3, 1001), 0), ((), 1), ((0,), 2)):
            tensor = torch.empty(shape, dtype=dtype)
            raw = tensor.reshape(-1).view(torch.uint8)
            raw.copy_(random_bytes(raw.numel(), seed))
            handle.sync_pwrite(tensor, path)

            back = handle.new_cpu_locked_tensor(tensor.numel(), tensor).view(shape)
            handle.sync_pread(back, path)
            assert back.dtype == dtype and back.shape == tensor.shape
            assert torch.equal(back.reshape(-1).view(torch.uint8), raw)


def test_non_contiguous_tensor_is_written_in_logical_order(tmp_path: Path) -> None:
    base = torch.arange(64 * 1000, dtype=torch.float32).reshape(64, 1000)
    strided = base[:, ::3]
    with AioHandle() as handle:
        handle.sync_pwrite(strided, tmp_path / "s.bin")
        back = torch.empty(strided.shape, dtype=strided.dtype)
        handle.sync_pread(back, tmp_path / "s.bin")
        with pytest.raises(ValueError, match="contiguous"):
            handle.sync_pread(back.t(), tmp_path / "s.bin")
    assert torch.equal(back, strided)


def test_validate_compares_with_a_buffered_read(
    tmp_path: Path, backend: str, random_bytes: Bytes
) -> None:
    data = random_bytes(200_003, seed=4)
    with AioHandle(backend=backend) as handle:  # type: ignore[arg-type]
        assert handle.pwrite(data, tmp_path / "v.bin", validate=True) == 1
        back = torch.empty_like(data)
        assert handle.pread(back, tmp_path / "v.bin", validate=True) == 1
    assert torch.equal(back, data)


def test_atomic_write_replaces_the_whole_file(
    tmp_path: Path, backend: str, random_bytes: Bytes, file_bytes: Bytes
) -> None:
    path = tmp_path / "ckpt.bin"
    path.write_bytes(b"x" * 1_000_000)
    data = random_bytes(123_457, seed=5)
    with AioHandle(backend=backend) as handle:  # type: ignore[arg-type]
        handle.async_pwrite(data, path, atomic=True)
        assert handle.wait() == 1
        with pytest.raises(ValueError, match="offset must be 0"):
            handle.sync_pwrite(data, path, offset=4096, atomic=True)
    assert os.path.getsize(path) == data.numel()
    assert torch.equal(file_bytes(path, 0, data.numel()), data)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.bin"]  # no temp file left
