"""Loads whose checksum threads hash (and copy) the files ahead of the loader, as on a machine
with a core to spare and the checkpoint in the page cache, with bytes written into one file
just before or just after the verdict: what the verified-copies tests of ds-engine share."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path


def write_at(path: Path, offset: int, data: bytes) -> None:
    """Write ``data`` at ``offset`` in place: the same file, as a mapping of it sees."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@contextlib.contextmanager
def hashed_ahead(
    file: Path,
    *,
    copy: bool,
    before_verdict: tuple[int, bytes] | None = None,
    after_verdict: tuple[int, bytes] | None = None,
) -> Iterator[None]:
    """Within it, a load's files are hashed ahead (a spare core, the files cached), copied while
    hashed when ``copy`` (and ds-native's kernel is built); ``before_verdict``: ``(offset,
    bytes)`` written into ``file`` once every hashing job is done and before the verdict;
    ``after_verdict``: just after it."""
    from ds_zero import _integrity

    pending = _integrity.PendingVerification
    saved = (_integrity.spare_core, _integrity.in_page_cache, _integrity.COPY_KERNEL, pending.wait)

    def wait(self, problems=(), **kwargs):
        if self._verdict is None and before_verdict is not None:
            for _, jobs, _, gaps in self._loaded.values():
                for job in (*jobs, gaps):
                    self._result(job)  # hashed (and copied): what follows happens after
            write_at(file, *before_verdict)
        manifest = saved[3](self, problems, **kwargs)
        if after_verdict is not None:
            write_at(file, *after_verdict)
        return manifest

    _integrity.spare_core = lambda: True
    _integrity.in_page_cache = lambda path, offsets: True
    _integrity.COPY_KERNEL = copy and saved[2]
    pending.wait = wait
    try:
        yield
    finally:
        (_integrity.spare_core, _integrity.in_page_cache, _integrity.COPY_KERNEL, pending.wait) = (
            saved
        )
