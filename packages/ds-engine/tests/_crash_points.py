"""Crash injection for checkpoint tests: every file-system call a save makes is a kill point.

:func:`crash_at` patches, for the duration of a ``with`` block, the calls through which ds (and
torch) change files: ``open`` for writing and every ``write``/``flush``/``close`` on such a
file, ``os.open`` (directory fsyncs), ``fsync``, ``rename``, ``replace``, ``mkdir``, ``rmdir``,
``unlink``/``remove``, ``symlink``, ``truncate`` and ``torch.save`` to a path. Call ``k``
(1-based) does not happen: the process is killed there (``os._exit``) or, in-process, a
:class:`Crash` is raised, which nothing in ds catches. ``k = 0`` only counts the calls.
Reads are not kill points: they change nothing.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["Crash", "CrashPlan", "crash_at"]

_OS_CALLS = (
    "rename",
    "replace",
    "fsync",
    "mkdir",
    "rmdir",
    "unlink",
    "remove",
    "symlink",
    "truncate",
    "ftruncate",
)


class Crash(BaseException):
    """The simulated kill (a BaseException: no ``except Exception`` in ds can swallow it)."""


class CrashPlan:
    """Counts file-system calls and kills at call ``at`` (0: never). ``calls`` names each one."""

    def __init__(self, at: int, *, hard: bool = False, skip: tuple[str, ...] = ()) -> None:
        self.at, self.hard, self.skip, self.calls = at, hard, skip, []

    def hit(self, what: str) -> None:
        if self.at and len(self.calls) >= self.at:  # dead: nothing after the kill happens
            raise Crash(f"killed at call {self.at}; {what} does not happen")
        if what.split(" ", 1)[0] in self.skip:
            return
        self.calls.append(what)
        if len(self.calls) == self.at:
            if self.hard:
                os._exit(9)
            raise Crash(f"killed at call {self.at}: {what}")


class _File(io.RawIOBase):
    """A file opened for writing whose writes, flushes and close are kill points."""

    def __init__(self, inner: Any, plan: CrashPlan, name: str) -> None:
        self._inner, self._plan, self._name = inner, plan, name

    def write(self, data: Any) -> int:
        self._plan.hit(f"write {self._name}")
        return self._inner.write(data)

    def flush(self) -> None:
        if not self._inner.closed:
            self._plan.hit(f"flush {self._name}")
            self._inner.flush()

    def close(self) -> None:
        if not self._inner.closed:
            self._plan.hit(f"close {self._name}")
            self._inner.close()

    def fileno(self) -> int:
        return self._inner.fileno()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._inner.seekable()

    def seek(self, *args: Any) -> int:
        return self._inner.seek(*args)

    def tell(self) -> int:
        return self._inner.tell()

    @property
    def closed(self) -> bool:
        return self._inner.closed

    def __enter__(self) -> _File:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _short(path: Any) -> str:
    text = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else str(path)
    parts = text.split(os.sep)
    return os.sep.join(parts[-3:])


@contextlib.contextmanager
def crash_at(at: int, *, hard: bool = False, skip: tuple[str, ...] = ()) -> Iterator[CrashPlan]:
    """Kill at the ``at``-th file-system call made inside the block (see the module docstring);
    calls whose kind is in ``skip`` (``"write"``, ``"flush"``) are not kill points."""
    plan = CrashPlan(at, hard=hard, skip=skip)
    saved: dict[tuple[Any, str], Any] = {}

    def patch(owner: Any, name: str, new: Any) -> None:
        saved[(owner, name)] = getattr(owner, name)
        setattr(owner, name, new)

    real_open, real_os_open, real_save = builtins.open, os.open, torch.save

    def opening(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real_open(file, mode, *args, **kwargs)
        if any(c in mode for c in "wax+"):
            plan.hit(f"open {_short(file)} {mode!r}")
            return _File(handle, plan, _short(file))
        return handle

    def os_opening(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC):
            plan.hit(f"os.open {_short(path)}")
        return real_os_open(path, flags, *args, **kwargs)

    def saving(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(f, (str, os.PathLike)):
            plan.hit(f"torch.save {_short(f)}")
        real_save(obj, f, *args, **kwargs)

    def os_call(name: str) -> Any:
        real = getattr(os, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            plan.hit(f"{name} {' '.join(_short(a) for a in args[:2])}")
            return real(*args, **kwargs)

        return call

    try:
        patch(builtins, "open", opening)
        patch(io, "open", opening)
        patch(os, "open", os_opening)
        patch(torch, "save", saving)
        for name in _OS_CALLS:
            patch(os, name, os_call(name))
        yield plan
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)
