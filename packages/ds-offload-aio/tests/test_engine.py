"""The movers on their own: request shapes, and kernel errors coming back through the C engine."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ds_offload_aio._pinned import allocate_locked
from ds_offload_aio._transfer import Mover, RequestShape, TransferFailure

Bytes = Callable[..., torch.Tensor]
BLOCK = 4096


def _direct_fd(path: Path, flags: int) -> int:
    return os.open(path, flags | os.O_DIRECT | os.O_CREAT, 0o644)


@pytest.mark.parametrize("single_submit", [False, True])
@pytest.mark.parametrize("overlap_events", [False, True])
@pytest.mark.parametrize("queue_depth", [1, 3, 64])
def test_request_shapes_move_every_byte(
    tmp_path: Path,
    backend: str,
    single_submit: bool,
    overlap_events: bool,
    queue_depth: int,
    random_bytes: Bytes,
) -> None:
    mover = Mover(backend, queue_depth)  # type: ignore[arg-type]
    shape = RequestShape(BLOCK, single_submit, overlap_events)
    nbytes = 37 * BLOCK  # not a multiple of the queue depth: a partial last batch
    source, target = allocate_locked(nbytes), allocate_locked(nbytes)
    source.copy_(random_bytes(nbytes, 7))
    path = tmp_path / "d.bin"
    fd = _direct_fd(path, os.O_RDWR)
    try:
        mover.transfer(fd, direct=True, is_read=False, address=source.data_ptr(), nbytes=nbytes,
                       offset=BLOCK, shape=shape)  # fmt: skip
        mover.transfer(fd, direct=True, is_read=True, address=target.data_ptr(), nbytes=nbytes,
                       offset=BLOCK, shape=shape)  # fmt: skip
    finally:
        os.close(fd)
        mover.close()
    assert torch.equal(target, source)
    assert os.path.getsize(path) == BLOCK + nbytes


def test_kernel_error_comes_back_with_its_offset(tmp_path: Path) -> None:
    # O_DIRECT from memory that is not block-aligned: the kernel answers EINVAL per request.
    mover = Mover("libaio", 8)
    memory = allocate_locked(3 * BLOCK)
    fd = _direct_fd(tmp_path / "x.bin", os.O_RDWR)
    try:
        with pytest.raises(TransferFailure) as info:
            mover.transfer(fd, direct=True, is_read=False, address=memory.data_ptr() + 1,
                           nbytes=2 * BLOCK, offset=8 * BLOCK, shape=RequestShape(BLOCK, False, True))  # fmt: skip
    finally:
        os.close(fd)
        mover.close()
    assert info.value.code == errno.EINVAL
    assert info.value.offset == 8 * BLOCK
    assert "aligned" in info.value.message


def test_short_read_at_end_of_file_reports_where_the_file_ends(
    tmp_path: Path, backend: str
) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(5 * BLOCK + 100))
    mover = Mover(backend, 4)  # type: ignore[arg-type]
    memory = allocate_locked(8 * BLOCK)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        with pytest.raises(TransferFailure) as info:
            mover.transfer(fd, direct=True, is_read=True, address=memory.data_ptr(),
                           nbytes=8 * BLOCK, offset=0, shape=RequestShape(BLOCK, False, True))  # fmt: skip
    finally:
        os.close(fd)
        mover.close()
    assert info.value.code is None
    assert "short read" in info.value.message
    # libaio reports the exact end; the preadv loop stops at the first empty block after it.
    assert 5 * BLOCK + 100 <= info.value.offset <= 6 * BLOCK


def test_io_context_limits_are_reported() -> None:
    limit = int(Path("/proc/sys/fs/aio-max-nr").read_text())
    with pytest.raises(OSError) as info:
        Mover("libaio", limit + 1)  # more requests than the system allows in flight
    assert info.value.errno == errno.EAGAIN
    assert f"io_setup({limit + 1})" in str(info.value)
