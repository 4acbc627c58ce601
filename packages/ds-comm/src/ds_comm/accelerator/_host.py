"""Host-side streams, events and memory figures for the CPU accelerator.

[Note: host streams and events]
CPU ops complete before they return, so a host stream has nothing to queue: it is a named,
always-idle stream whose ``wait_*``/``synchronize`` return at once. It still exists as an object,
so code written for CUDA (``with acc.stream(s):``, ``s.wait_stream(acc.current_stream())``,
timers built on ``Event(enable_timing=True)``) runs unchanged and means the same: an event
records the host clock (``time.perf_counter``) when ``record()`` is called, and
``elapsed_time`` is the milliseconds between two recorded events. As with ``torch.cuda.Event``,
timing needs ``enable_timing=True`` and both events recorded; anything else is an error, so a
timer bug shows on CPU too.

[Note: host memory figures]
On CPU, "allocated" and "reserved" are the process's resident set size (``/proc/self/statm``),
the peak is the kernel's high-water mark (``VmHWM``), and a reset writes ``5`` to
``/proc/self/clear_refs`` (Linux >= 4.0), which restarts that mark from the current size. Where
the kernel refuses the reset, the peak is the largest size seen since the reset by ds itself.
Total and available memory are ``MemTotal``/``MemAvailable`` from ``/proc/meminfo``, capped by
the cgroup's ``memory.max`` when the process runs in a container with a limit.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["HostEvent", "HostMemory", "HostStream", "current_host_stream", "use_host_stream"]


class HostStream:
    """A stream on the host: work is done when issued (see [Note: host streams and events])."""

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = "cpu"
        self.priority = priority

    def query(self) -> bool:
        """True: all work issued to a host stream has completed."""
        return True

    def synchronize(self) -> None:
        """Nothing is pending on a host stream."""

    def wait_stream(self, stream: Any) -> None:
        """Order later work after ``stream``'s: host work is already ordered."""
        if hasattr(stream, "synchronize"):
            stream.synchronize()

    def wait_event(self, event: Any) -> None:
        """Order later work after ``event``: a recorded host event has already happened."""
        if hasattr(event, "synchronize"):
            event.synchronize()

    def record_event(self, event: HostEvent | None = None) -> HostEvent:
        """Record ``event`` (a new one when None) now, and return it."""
        event = event if event is not None else HostEvent()
        event.record(self)
        return event

    def __repr__(self) -> str:
        return f"HostStream(id={id(self):#x})"


class HostEvent:
    """An event on the host clock: ``record()`` stamps ``time.perf_counter()``."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self.enable_timing = enable_timing
        self.blocking = blocking
        self.interprocess = interprocess
        self._time: float | None = None

    def record(self, stream: Any = None) -> None:
        """Stamp the current host time."""
        self._time = time.perf_counter()

    def query(self) -> bool:
        """True: recorded host work has completed (an unrecorded event counts as done, as in CUDA)."""
        return True

    def synchronize(self) -> None:
        """Nothing to wait for on the host."""

    def wait(self, stream: Any = None) -> None:
        """Make ``stream`` wait for this event: host work is already ordered."""

    def elapsed_time(self, end_event: HostEvent) -> float:
        """Milliseconds from this event's ``record()`` to ``end_event``'s.

        Raises:
            RuntimeError: either event lacks ``enable_timing=True`` or was never recorded.
        """
        for name, event in (("start", self), ("end", end_event)):
            if not isinstance(event, HostEvent):
                raise TypeError(
                    f"elapsed_time: {name} event is {type(event).__name__}, not HostEvent"
                )
            if not event.enable_timing:
                raise RuntimeError(
                    f"elapsed_time: the {name} event was created without enable_timing=True"
                )
            if event._time is None:
                raise RuntimeError(f"elapsed_time: the {name} event was never recorded")
        assert self._time is not None and end_event._time is not None
        return (end_event._time - self._time) * 1000.0

    def __repr__(self) -> str:
        return f"HostEvent(enable_timing={self.enable_timing}, recorded={self._time is not None})"


_DEFAULT_STREAM = HostStream()
_current = threading.local()


def current_host_stream() -> HostStream:
    """This thread's current host stream (the default one outside ``use_host_stream``)."""
    return getattr(_current, "stream", None) or _DEFAULT_STREAM


def default_host_stream() -> HostStream:
    """The process's default host stream."""
    return _DEFAULT_STREAM


@contextlib.contextmanager
def use_host_stream(stream: HostStream | None) -> Iterator[HostStream | None]:
    """Make ``stream`` this thread's current host stream inside the block (None: no change)."""
    if stream is None:
        yield None
        return
    if not isinstance(stream, HostStream):
        raise TypeError(f"stream(): expected a HostStream on the CPU accelerator, got {stream!r}")
    previous = getattr(_current, "stream", None)
    _current.stream = stream
    try:
        yield stream
    finally:
        _current.stream = previous


def _read_kib(path: str, key: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class HostMemory:
    """The process's and host's memory figures (see [Note: host memory figures])."""

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE")
        # The kernel's mark counts from process start until the first reset, like torch.cuda's.
        self._kernel_peak = os.access("/proc/self/clear_refs", os.W_OK)
        self._peak = self.rss()

    def rss(self) -> int:
        """Resident set size of this process, in bytes."""
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self._page
        except (OSError, ValueError, IndexError):
            # Not Linux: the best figure left is the peak (ru_maxrss is KiB on Linux, bytes on macOS)
            usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return usage if os.uname().sysname == "Darwin" else usage * 1024

    def peak(self) -> int:
        """Peak resident set size since the last :meth:`reset_peak`, in bytes."""
        now = self.rss()
        if self._kernel_peak:
            hwm = _read_kib("/proc/self/status", "VmHWM:")
            if hwm is not None:
                return max(hwm, now)
        self._peak = max(self._peak, now)
        return self._peak

    def reset_peak(self) -> None:
        """Restart the peak from the current resident size."""
        self._kernel_peak = self._reset_kernel_peak()
        self._peak = self.rss()

    @staticmethod
    def _reset_kernel_peak() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def total(self) -> int:
        """Bytes of memory this process may use: the host's, capped by a cgroup limit."""
        total = _read_kib("/proc/meminfo", "MemTotal:")
        if total is None:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        limit = self._cgroup_limit()
        return min(total, limit) if limit else total

    def available(self) -> int:
        """Bytes that can still be allocated without swapping (host, capped by the cgroup)."""
        free = _read_kib("/proc/meminfo", "MemAvailable:")
        if free is None:
            free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        limit = self._cgroup_limit()
        if limit:
            used = self._cgroup_usage()
            if used is not None:
                free = min(free, max(limit - used, 0))
        return free

    @staticmethod
    def _cgroup_limit() -> int | None:
        for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
            try:
                with open(path) as f:
                    raw = f.read().strip()
            except OSError:
                continue
            if raw.isdigit() and int(raw) < (1 << 60):  # cgroup v1 "no limit" is ~2**63
                return int(raw)
            return None
        return None

    @staticmethod
    def _cgroup_usage() -> int | None:
        for path in (
            "/sys/fs/cgroup/memory.current",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ):
            try:
                with open(path) as f:
                    return int(f.read().strip())
            except (OSError, ValueError):
                continue
        return None
