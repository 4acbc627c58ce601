"""Opening files for one op: O_DIRECT where the filesystem allows it, atomic replace on request.

[Note: two descriptors per file]
Every op opens its file twice: with O_DIRECT for the aligned body (no page cache, DMA straight
from the buffer) and without it for the unaligned head and tail of the range and for validation.
The kernel keeps the two coherent: an O_DIRECT write invalidates cached pages of its range, and an
O_DIRECT read writes back dirty cached pages of its range first. A filesystem that refuses
O_DIRECT (``open`` fails with EINVAL) gets buffered I/O for the whole range, reported once per
directory with ``AioFallbackWarning``.

[Note: a failed write leaves no file it created]
An atomic write goes to a temp file beside the final name, removed on failure. A plain write
opens the final name itself, so it first tries to create it exclusively (``O_EXCL``) and
remembers whether it did: when the op fails (open, preallocation on a full disk, a transfer, the
validation), a file the op created is unlinked, so no empty or partial file is left under the
final name. A file that existed before keeps its name (its old bytes in the failed range may be
gone: use ``atomic=True`` where that matters). Two plain writes racing to create the same new
file are the caller's race: when the creating one fails, the file goes, and the other op's bytes
with it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import uuid
from dataclasses import dataclass

from ds_offload_aio import _ext
from ds_offload_aio.api import AioError


@dataclass
class OpenFile:
    """The descriptors of one op's file. ``path`` is the name errors use (the final name)."""

    path: str
    io_path: str
    buffered_fd: int
    direct_fd: int | None
    regular: bool
    atomic: bool = False
    created: bool = False  # a plain write created ``path`` (see [Note: a failed write ...])

    def close(self) -> None:
        for fd in (self.direct_fd, self.buffered_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.direct_fd = None


def _open(path: str, flags: int, *, op: str, offset: int) -> int:
    try:
        return os.open(path, flags | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise AioError(exc.errno, exc.strerror or str(exc), path, offset=offset, op=op) from None


def _open_direct(path: str, flags: int, *, op: str, offset: int) -> int | None:
    try:
        return os.open(path, flags | os.O_DIRECT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise AioError(
                exc.errno, exc.strerror or str(exc), path, offset=offset, op=op
            ) from None
    directory = os.path.dirname(os.path.abspath(path))
    _ext.warn_once(
        f"ds_offload_aio: O_DIRECT is not supported for files in {directory} (open: EINVAL); "
        "using buffered I/O there, so the page cache is involved"
    )
    return None


def open_for_read(path: str, *, offset: int, nbytes: int) -> OpenFile:
    """Opens ``path`` for reading ``nbytes`` at ``offset``; a regular file must hold them."""
    buffered = _open(path, os.O_RDONLY, op="read", offset=offset)
    try:
        info = os.fstat(buffered)
        if stat.S_ISDIR(info.st_mode):
            raise AioError(errno.EISDIR, os.strerror(errno.EISDIR), path, offset=offset, op="read")
        regular = stat.S_ISREG(info.st_mode)
        if regular and nbytes and info.st_size < offset + nbytes:
            raise AioError(
                None,
                f"read past end of file: bytes [{offset}, {offset + nbytes}) requested, "
                f"the file has {info.st_size}",
                path,
                offset=offset,
                op="read",
            )
        direct = _open_direct(path, os.O_RDONLY, op="read", offset=offset)
    except BaseException:
        os.close(buffered)
        raise
    return OpenFile(path, path, buffered, direct, regular)


def open_for_write(path: str, *, offset: int, nbytes: int, atomic: bool) -> OpenFile:
    """Opens (creating, never truncating) ``path``, or a temp file beside it when ``atomic``.

    The range is allocated up front (``posix_fallocate``): O_DIRECT writes that extend a file
    are serialised by some filesystems, and a full disk is reported here, before any data moves.
    """
    if atomic:
        head, name = os.path.split(path)
        io_path = os.path.join(head, f".{name}.{uuid.uuid4().hex[:12]}.tmp")
        buffered = _open(io_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, op="write", offset=offset)
        created = True
    else:
        io_path = path
        buffered, created = _open_plain(path, offset=offset)
    opened = OpenFile(path, io_path, buffered, None, regular=False, atomic=atomic, created=created)
    try:
        info = os.fstat(buffered)
        opened.regular = stat.S_ISREG(info.st_mode)
        if opened.regular and nbytes and info.st_size < offset + nbytes:
            _preallocate(opened, offset, nbytes)
        opened.direct_fd = _open_direct(io_path, os.O_WRONLY, op="write", offset=offset)
    except BaseException:
        abort(opened)
        raise
    return opened


def _open_plain(path: str, *, offset: int) -> tuple[int, bool]:
    """The final name opened for a plain write, and whether this call created it."""
    for _ in range(8):  # another process may create or remove the file between the two opens
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644), True
        except FileExistsError:
            pass
        except OSError as exc:
            raise AioError(
                exc.errno, exc.strerror or str(exc), path, offset=offset, op="write"
            ) from None
        try:
            return os.open(path, os.O_RDWR | os.O_CLOEXEC), False
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise AioError(
                exc.errno, exc.strerror or str(exc), path, offset=offset, op="write"
            ) from None
    return _open(path, os.O_RDWR | os.O_CREAT, op="write", offset=offset), False


def _preallocate(opened: OpenFile, offset: int, nbytes: int) -> None:
    try:
        os.posix_fallocate(opened.buffered_fd, offset, nbytes)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return  # the filesystem cannot preallocate; the writes allocate as they go
        raise AioError(
            exc.errno, exc.strerror or str(exc), opened.path, offset=offset, op="write"
        ) from None


def commit(opened: OpenFile) -> None:
    """Closes a written file; an atomic write is fsynced and renamed over its final name."""
    if not opened.atomic:
        opened.close()
        return
    try:
        os.fsync(opened.buffered_fd)
        opened.close()
        os.replace(opened.io_path, opened.path)
        directory = os.open(os.path.dirname(os.path.abspath(opened.path)), os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except OSError as exc:
        abort(opened)
        raise AioError(
            exc.errno, f"atomic commit: {exc.strerror}", opened.path, offset=0, op="write"
        ) from None


def abort(opened: OpenFile) -> None:
    """Closes a file whose op failed; removes the atomic write's temp file, and the final name
    when a plain write created it (see [Note: a failed write leaves no file it created])."""
    opened.close()
    if opened.created:
        with contextlib.suppress(OSError):
            os.unlink(opened.io_path)
