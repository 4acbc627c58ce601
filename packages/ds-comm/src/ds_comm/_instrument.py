"""The one path every ds-comm collective takes: sequence numbers, fingerprints, in-flight tracking.

Each public op in ``_collectives.py`` calls :func:`tracked` with a closure that issues the torch op.
Here the call gets a per-group sequence number and a :class:`Fingerprint` (op, shapes, dtype, call
site), is marked in flight (the hang watchdog reads this), and on completion is handed to the comms
logger. For async ops completion is the ``wait()`` of the returned :class:`TrackedWork`.
Point-to-point ops skip the closure: they call :func:`begin_one` and wrap the torch work in a
:class:`TrackedWork` themselves (see [Note: cheap tracking]).

See [Note: hang forensics] in ``_forensics.py`` for how fingerprints are used when a call hangs.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import CodeType
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

__all__ = [
    "P2P_OPS",
    "CallRecord",
    "Fingerprint",
    "TrackedWork",
    "annotate",
    "begin_one",
    "check_devices",
    "group_ranks",
    "tracked",
]

# Point-to-point ops: only two ranks of the group take part, so group-wide checks skip them.
P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "batch_isend_irecv"})
# Ops whose tensor shapes legitimately differ per rank (uneven splits, gather lists only on the
# root), so shapes are left out of what must agree across ranks.
_PER_RANK_SHAPES = frozenset(
    {"all_to_all_single", "all_to_all", "all_gather", "gather", "scatter", "reduce_scatter"}
)

_SITE: contextvars.ContextVar[str | None] = contextvars.ContextVar("ds_comm_site", default=None)
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


class Fingerprint(NamedTuple):
    """What a rank believes it is doing: compared across ranks to explain hangs and mismatches.

    A ``NamedTuple`` (immutable, hashable, picklable for ``all_gather_object``); built only when
    someone reads :attr:`CallRecord.fingerprint`, see [Note: cheap tracking].
    """

    op: str
    seq: int
    group: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: str
    site: str

    def describe(self) -> str:
        """Short human form, e.g. ``all_gather #1042 (layers.7.mlp)``."""
        return f"{self.op} #{self.seq} ({self.site})"

    def signature(self) -> tuple[Any, ...]:
        """The part that must agree across ranks (the call site may legitimately differ)."""
        shapes = None if self.op in _PER_RANK_SHAPES else self.shapes
        return (self.op, self.seq, self.group, shapes, self.dtype)


class CallRecord:
    """One collective call in progress or done.

    ``group`` is the process group object (``None`` for the default group), kept so hooks can
    issue their own raw ops on it. ``blocking`` is True while the issuing thread waits on the
    call (from the start for sync ops, from ``wait()`` for async ones): when several calls are in
    flight, the blocking one is where a hung rank is stuck.

    [Note: cheap tracking]
    Every ds-comm call, point-to-point ones included (a pipeline stage issues thousands per
    second), makes one record, so building it must cost next to nothing: the record keeps the
    raw facts the call already has (op, seq, the group's ranks, the tensors' ``torch.Size`` s,
    which are tuples already, the ``torch.dtype``, the call site) in ``__slots__``, and the
    :class:`Fingerprint` that hooks, the logger and hang reports read is assembled on first
    access and cached. The facts are captured when the call starts, so a fingerprint built later
    (e.g. by the watchdog of a hung call) says what was issued even if the caller has since
    resized its tensors.
    """

    __slots__ = (
        "_dtype",
        "_fp",
        "_shapes",
        "_site",
        "algo",
        "async_op",
        "blocking",
        "device",
        "end",
        "group",
        "msg_bytes",
        "op",
        "ranks",
        "seq",
        "start",
    )

    def __init__(
        self,
        op: str,
        seq: int,
        ranks: tuple[int, ...],
        shapes: tuple[tuple[int, ...], ...],
        dtype: torch.dtype | None,
        site: str,
        msg_bytes: int,
        algo: str,
        async_op: bool,
        group: Any = None,
        device: str = "cpu",
        blocking: bool = False,
    ) -> None:
        self.op = op
        self.seq = seq
        self.ranks = ranks
        self._shapes = shapes
        self._dtype = dtype
        self._site = site
        self._fp: Fingerprint | None = None
        self.msg_bytes = msg_bytes
        self.algo = algo
        self.async_op = async_op
        self.group = group
        self.device = device
        self.blocking = blocking
        self.start = time.perf_counter()
        self.end: float | None = None

    @property
    def fingerprint(self) -> Fingerprint:
        fp = self._fp
        if fp is None:
            shapes = tuple(tuple(s) for s in self._shapes)
            fp = self._fp = Fingerprint(
                self.op, self.seq, self.ranks, shapes, _dtype_name(self._dtype), self._site
            )
        return fp

    @property
    def latency_s(self) -> float:
        return (self.end if self.end is not None else time.perf_counter()) - self.start

    def __repr__(self) -> str:
        return (
            f"CallRecord({self.fingerprint!r}, msg_bytes={self.msg_bytes}, algo={self.algo!r}, "
            f"async_op={self.async_op}, device={self.device!r}, blocking={self.blocking})"
        )


class _Tracker:
    """Per-process bookkeeping: sequence counters per group and the calls now in flight."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # Per group (its global ranks); point-to-point calls count apart (key ends in "p2p").
        self.seq: dict[tuple[Any, ...], int] = {}
        self.in_flight: dict[int, CallRecord] = {}
        self.last: CallRecord | None = None
        # perf_counter() when the latest call completed; the exit hook reads it (_exit.py).
        self.last_end = float("-inf")
        self.ranks_cache: dict[int, tuple[int, ...]] = {}
        # Hooks set by the logger / forensics modules; kept as plain attributes so the
        # disabled case costs one attribute read per call.
        self.on_begin: list[Callable[[CallRecord], None]] = []
        self.on_end: list[Callable[[CallRecord], None]] = []
        # Called with (record, exception) when an op raises; a hook may raise a clearer error
        # (e.g. a gloo timeout becomes CollectiveTimeoutError naming where every rank is).
        self.on_error: list[Callable[[CallRecord, BaseException], None]] = []
        # Set while the device guard is on (_device_guard.py): checks every tensor argument
        # before a call is registered, so a refused call uses no sequence number.
        self.device_check: Callable[[str, Any, Sequence[torch.Tensor]], None] | None = None

    def reset(self) -> None:
        with self.lock:
            self.seq.clear()
            self.in_flight.clear()
            self.last = None
            self.ranks_cache.clear()


TRACKER = _Tracker()


def group_ranks(group: Any | None) -> tuple[int, ...]:
    """Global ranks of ``group`` (``None`` is the default group), cached per group object."""
    key = id(group)
    ranks = TRACKER.ranks_cache.get(key)
    if ranks is None:
        pg = group if group is not None else dist.group.WORLD
        ranks = tuple(dist.get_process_group_ranks(pg))
        TRACKER.ranks_cache[key] = ranks
    return ranks


@contextlib.contextmanager
def annotate(site: str) -> Iterator[None]:
    """Name the code issuing collectives (e.g. ``"layers.7.mlp"``) for fingerprints and hang reports.

    Example:
        >>> with ds_comm.annotate("layers.7.mlp"):
        ...     ds_comm.all_gather_into_tensor(out, shard)
    """
    token = _SITE.set(site)
    try:
        yield
    finally:
        _SITE.reset(token)


# Per code object: is it ds-comm's or torch's own code (skipped when naming the call site)?
_INTERNAL_CODE: dict[CodeType, bool] = {}
_SITE_NAMES: dict[tuple[CodeType, int], str] = {}


def _call_site() -> str:
    """``file.py:line`` of the first caller outside ds-comm and torch (cached: runs every call)."""
    site = _SITE.get()
    if site is not None:
        return site
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        internal = _INTERNAL_CODE.get(code)
        if internal is None:
            internal = _INTERNAL_CODE[code] = code.co_filename.startswith(
                (_PACKAGE_DIR, _TORCH_DIR)
            )
        if not internal:
            key = (code, frame.f_lineno)
            name = _SITE_NAMES.get(key)
            if name is None:
                name = _SITE_NAMES[key] = f"{os.path.basename(code.co_filename)}:{key[1]}"
            return name
        frame = frame.f_back
    return "?"


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype | None) -> str:
    if dtype is None:
        return "-"
    name = _DTYPE_NAMES.get(dtype)
    if name is None:  # str(dtype) costs ~0.8 us
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _device(t: torch.Tensor) -> str:
    # device.type costs ~0.8 us; is_cuda / is_cpu are cheap.
    return "cuda" if t.is_cuda else "cpu" if t.is_cpu else t.device.type


def check_devices(op: str, group: Any | None, tensors: Sequence[torch.Tensor]) -> None:
    """Run the device guard on ``tensors`` now, when it is on (composite ops check up front)."""
    if TRACKER.device_check is not None:
        TRACKER.device_check(op, group, tensors)


def begin(
    op: str,
    group: Any | None,
    tensors: Sequence[torch.Tensor],
    *,
    msg_bytes: int,
    algo: str,
    async_op: bool = False,
) -> CallRecord:
    """Register the start of a collective and return its record.

    A hook that raises (e.g. the debug-mode fingerprint check) aborts the call before the op is
    issued; the call is then reported through ``failed`` like an op error.
    """
    if TRACKER.device_check is not None:
        TRACKER.device_check(op, group, tensors)
    shapes = tuple([t.shape for t in tensors])
    if tensors:
        first = tensors[0]
        return _begin(
            op, group, shapes, first.dtype, _device(first), _call_site(), msg_bytes, algo, async_op
        )
    return _begin(op, group, shapes, None, "cpu", _call_site(), msg_bytes, algo, async_op)


def begin_one(
    op: str, group: Any | None, tensor: torch.Tensor, algo: str, async_op: bool
) -> CallRecord:
    """:func:`begin` for a call on the single ``tensor`` (the point-to-point fast path)."""
    if TRACKER.device_check is not None:
        TRACKER.device_check(op, group, (tensor,))
    return _begin(
        op, group, (tensor.shape,), tensor.dtype, _device(tensor), _call_site(),
        tensor.nbytes, algo, async_op,
    )  # fmt: skip


def _begin(
    op: str,
    group: Any | None,
    shapes: tuple[tuple[int, ...], ...],
    dtype: torch.dtype | None,
    device: str,
    site: str,
    msg_bytes: int,
    algo: str,
    async_op: bool,
) -> CallRecord:
    ranks = group_ranks(group)
    # Point-to-point calls involve two members only: counting them with the group's collectives
    # would put the other members' sequence numbers out of step.
    key = ranks if op not in P2P_OPS else (*ranks, "p2p")
    tracker = TRACKER
    # The lock keeps each group's numbering gapless and in issue order when helper threads
    # (ring algorithms, the watchdog's reads) run alongside the main thread.
    with tracker.lock:
        seq = tracker.seq.get(key, 0) + 1
        tracker.seq[key] = seq
        rec = CallRecord(
            op, seq, ranks, shapes, dtype, site, msg_bytes, algo, async_op, group, device,
            not async_op,
        )  # fmt: skip
        tracker.in_flight[id(rec)] = rec
        tracker.last = rec
    if tracker.on_begin:
        try:
            for hook in tracker.on_begin:
                hook(rec)
        except BaseException as exc:
            failed(rec, exc)
            raise
    return rec


def end(rec: CallRecord) -> None:
    """Register the completion of a collective."""
    rec.end = TRACKER.last_end = time.perf_counter()
    with TRACKER.lock:
        TRACKER.in_flight.pop(id(rec), None)
    for hook in TRACKER.on_end:
        hook(rec)


def failed(rec: CallRecord, exc: BaseException) -> None:
    """A call raised: forget it as in flight and let the error hooks translate the exception.

    Returns normally when no hook replaced the error; the caller then re-raises the original.
    The hooks run while the call still counts as in flight: a timeout hook that waits for the
    hang diagnosis needs this rank reported as inside the call, not as idle.
    """
    try:
        for hook in TRACKER.on_error:
            hook(rec, exc)
    finally:
        with TRACKER.lock:
            TRACKER.in_flight.pop(id(rec), None)


class TrackedWork:
    """An async work handle whose ``wait()`` completes the call's record (timing, logging).

    [Note: waited work objects]
    Once waited, a handle drops the backend's work object. Callers keep handles longer than the
    process group (an optimizer's list of reductions, destroyed with the optimizer after
    ``destroy_process_group()``), and a gloo work object destroyed after its group aborts the
    process at exit ("terminate called without an active exception"). The same abort has a
    second cause, a gloo worker thread still holding a finished op's tensors when the
    interpreter finalizes; see [Note: gloo workers at interpreter exit] in _exit.py.
    """

    __slots__ = ("_done", "_finish", "_rec", "_work")

    def __init__(
        self, work: Any, rec: CallRecord, finish: Callable[[], None] | None = None
    ) -> None:
        self._work = work
        self._rec = rec
        self._finish = finish
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        if self._done:
            return True
        rec = self._rec
        rec.blocking = True
        work = self._work
        try:
            if work is not None:
                work.wait() if timeout is None else work.wait(timeout)
            if self._finish is not None:
                self._finish()
        except BaseException as exc:
            failed(rec, exc)
            raise
        self._done = True
        self._work = self._finish = None  # see [Note: waited work objects]
        end(rec)
        return True

    def is_completed(self) -> bool:
        return self._done or (self._work is None or self._work.is_completed())

    def get_future(self) -> Any:
        if self._work is None:  # waited already: a completed future
            future: torch.futures.Future[Any] = torch.futures.Future()
            future.set_result(None)
            return future
        return self._work.get_future()

    def result(self) -> Any:
        """Wait; the output lives in the tensors the call was given (None is returned)."""
        self.wait()
        return None


def tracked(
    op: str,
    group: Any | None,
    tensors: Sequence[torch.Tensor],
    *,
    msg_bytes: int,
    algo: str,
    async_op: bool,
    run: Callable[[], Any],
    finish: Callable[[], None] | None = None,
) -> TrackedWork | None:
    """Run ``run()`` (which issues the torch op and returns its work handle or None) as a tracked call.

    ``finish`` runs after the op completes (e.g. copying a fallback's result into the caller's
    output). With ``async_op`` the caller gets a :class:`TrackedWork`; otherwise this waits.
    """
    rec = begin(op, group, tensors, msg_bytes=msg_bytes, algo=algo, async_op=async_op)
    try:
        work = run()
    except BaseException as exc:
        failed(rec, exc)
        raise
    handle = TrackedWork(work, rec, finish)
    if async_op:
        return handle
    handle.wait()
    return None
