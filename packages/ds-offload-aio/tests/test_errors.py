"""Errors are never lost: each surfaces from the sync call or wait(), naming file and offset."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ds_offload_aio import AioError, AioFallbackWarning, AioHandle, _ext, _transfer


def test_missing_file_fails_the_sync_call(tmp_path: Path, backend: str) -> None:
    path = tmp_path / "missing.bin"
    with AioHandle(backend=backend) as handle, pytest.raises(AioError) as info:  # type: ignore[arg-type]
        handle.sync_pread(torch.empty(10), path, offset=8192)
    assert info.value.errno == errno.ENOENT
    assert info.value.filename == str(path)
    assert info.value.offset == 8192
    assert str(path) in str(info.value) and "offset 8192" in str(info.value)


def test_async_errors_surface_from_wait(tmp_path: Path, backend: str) -> None:
    good = tmp_path / "good.bin"
    good.write_bytes(bytes(4096))
    with AioHandle(backend=backend) as handle:  # type: ignore[arg-type]
        assert handle.async_pread(torch.empty(4096, dtype=torch.uint8), good) == 0
        for i in range(3):
            assert handle.async_pread(torch.empty(16), tmp_path / f"missing{i}.bin") == 0
        with pytest.raises(AioError) as info:
            handle.wait()
        assert info.value.filename == str(tmp_path / "missing0.bin")
        if sys.version_info >= (3, 11):
            assert "2 more of the 4 ops failed too" in info.value.__notes__
        # The handle is still usable, and nothing is left pending.
        assert handle.wait() == 0
        assert handle.sync_pread(torch.empty(4096, dtype=torch.uint8), good) == 1


def test_read_past_end_of_file(tmp_path: Path, backend: str) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(bytes(10_000))
    with AioHandle(backend=backend) as handle, pytest.raises(AioError) as info:  # type: ignore[arg-type]
        handle.sync_pread(torch.empty(8192, dtype=torch.uint8), path, offset=4096)
    assert info.value.errno is None
    assert info.value.offset == 4096
    assert "past end of file" in str(info.value) and "the file has 10000" in str(info.value)


def test_reading_a_directory_names_the_error(tmp_path: Path) -> None:
    with AioHandle() as handle, pytest.raises(AioError) as info:
        handle.sync_pread(torch.empty(10), tmp_path)
    assert info.value.errno == errno.EISDIR


def test_full_device_fails_loudly_and_o_direct_falls_back_once(backend: str) -> None:
    # /dev/full refuses O_DIRECT (EINVAL at open): buffered I/O is used, warned once per directory.
    _ext.warn_once.cache_clear()
    with AioHandle(backend=backend) as handle, warnings.catch_warnings(record=True) as caught:  # type: ignore[arg-type]
        warnings.simplefilter("always")
        for _ in range(2):
            with pytest.raises(AioError) as info:
                handle.sync_pwrite(torch.ones(8192, dtype=torch.uint8), "/dev/full")
            assert info.value.errno == errno.ENOSPC
            assert info.value.filename == "/dev/full" and info.value.offset == 0
        zeros = torch.ones(10_000, dtype=torch.uint8)
        handle.sync_pread(zeros, "/dev/zero", offset=12345)
    assert torch.count_nonzero(zeros) == 0
    messages = [str(w.message) for w in caught if issubclass(w.category, AioFallbackWarning)]
    assert messages == [
        "ds_offload_aio: O_DIRECT is not supported for files in /dev (open: EINVAL); using "
        "buffered I/O there, so the page cache is involved"
    ]


def _write_past_file_size_limit(directory: Path, backend: str, data: torch.Tensor) -> dict:
    """In a forked child: RLIMIT_FSIZE ("file too large") stands in for a full disk, no root."""
    ckpt = directory / "ckpt.bin"
    ckpt.write_bytes(b"old" * 1000)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    errors = {}
    with AioHandle(backend=backend) as handle:  # type: ignore[arg-type]
        for name, target, atomic in (
            ("plain", directory / "big.bin", False),
            ("atomic", ckpt, True),
        ):
            try:
                handle.sync_pwrite(data, target, atomic=atomic)
            except AioError as exc:
                errors[name] = [exc.errno, exc.filename, exc.offset]
    return {"errors": errors, "files": sorted(os.listdir(directory)), "ckpt": ckpt.read_text()}


def _in_child(fn: Callable[..., dict], *args: object) -> dict:
    """Runs ``fn`` in a forked child (process limits must not touch the test process)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (child)
        os.close(read_end)
        try:
            result = {"ok": fn(*args)}
        except BaseException as exc:
            result = {"error": repr(exc)}
        os.write(write_end, json.dumps(result).encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        report = json.loads(pipe.read() or "{}")
    os.waitpid(pid, 0)
    assert "ok" in report, report
    return report["ok"]


def test_write_past_the_file_size_limit_fails_and_atomic_keeps_the_old_file(
    tmp_path: Path, backend: str
) -> None:
    data = torch.ones(4 << 20, dtype=torch.uint8)
    report = _in_child(_write_past_file_size_limit, tmp_path, backend, data)
    big, ckpt = str(tmp_path / "big.bin"), str(tmp_path / "ckpt.bin")
    assert report["errors"] == {"plain": [errno.EFBIG, big, 0], "atomic": [errno.EFBIG, ckpt, 0]}
    # The plain write created big.bin and removed it on failure; the atomic write's temp file is
    # gone and the old checkpoint is intact.
    assert report["files"] == ["ckpt.bin"]
    assert report["ckpt"] == "old" * 1000


@contextlib.contextmanager
def _tiny_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A ``size`` tmpfs mounted at ``where`` (a real full disk), or a skip without the right."""
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip()}); RLIMIT_FSIZE covers it")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_full_disk_leaves_no_file_the_write_created(tmp_path: Path, backend: str) -> None:
    with _tiny_tmpfs(tmp_path / "disk", "256k") as disk:
        (disk / "old.bin").write_bytes(b"old" * 1000)
        data = torch.ones(1 << 20, dtype=torch.uint8)
        with AioHandle(backend=backend) as handle:  # type: ignore[arg-type]
            for name, atomic in (("new.bin", False), ("new.bin", True), ("old.bin", True)):
                with pytest.raises(AioError) as info:
                    handle.sync_pwrite(data, disk / name, atomic=atomic)
                assert info.value.errno == errno.ENOSPC
                assert info.value.filename == str(disk / name)
            # A plain write over a file that existed keeps that file (it did not create it).
            with pytest.raises(AioError):
                handle.sync_pwrite(data, disk / "old.bin")
        assert sorted(os.listdir(disk)) == ["old.bin"]


def test_transfer_error_midway_removes_the_file_the_write_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A write error after part of the data reached the file (fault-injected into the thread
    # backend's mover): the partial file must not stay under the final name.
    real = _transfer.posix_transfer
    calls = []

    def failing(fd: int, is_read: bool, address: int, nbytes: int, offset: int, block: int) -> None:
        calls.append(offset)
        if len(calls) == 1:
            real(fd, is_read, address, nbytes // 2, offset, block)
            raise _transfer.TransferFailure(errno.EIO, offset + nbytes // 2, "injected EIO")
        real(fd, is_read, address, nbytes, offset, block)

    monkeypatch.setattr(_transfer, "posix_transfer", failing)
    with AioHandle(backend="threads") as handle:
        with pytest.raises(AioError) as info:
            handle.sync_pwrite(torch.ones(1 << 16, dtype=torch.uint8), tmp_path / "part.bin")
        assert info.value.errno == errno.EIO and info.value.filename == str(tmp_path / "part.bin")
        assert calls
        assert os.listdir(tmp_path) == []
        # Asynchronous too: the error surfaces from wait(), the file is gone by then.
        calls.clear()
        handle.async_pwrite(torch.ones(1 << 16, dtype=torch.uint8), tmp_path / "async.bin")
        with pytest.raises(AioError):
            handle.wait()
        assert os.listdir(tmp_path) == []
        # A later write of the same name succeeds and leaves exactly its bytes.
        handle.sync_pwrite(torch.full((4096,), 7, dtype=torch.uint8), tmp_path / "part.bin")
    assert (tmp_path / "part.bin").read_bytes() == bytes([7]) * 4096


def test_bad_arguments_raise_at_the_call(tmp_path: Path) -> None:
    with AioHandle() as handle:
        with pytest.raises(TypeError, match=r"torch\.Tensor"):
            handle.sync_pwrite(b"bytes", tmp_path / "x")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="offset = -1"):
            handle.sync_pwrite(torch.ones(3), tmp_path / "x", offset=-1)
    with pytest.raises(RuntimeError, match="closed"):
        handle.sync_pwrite(torch.ones(3), tmp_path / "x")
