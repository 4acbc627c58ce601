"""Hang forensics and the debug fingerprint check: say which rank is where when collectives diverge.

[Note: hang forensics]
The most common distributed failure is a silent hang: ranks took different code paths (a rank
skipped a ZeRO-3 gather, or called ``reduce_scatter`` where the others call ``all_gather``), and
every rank waits until the process-group timeout kills the job with no hint of why. Every ds-comm
op goes through ``_instrument.tracked``, so each rank always knows its in-flight calls and its
last one as a :class:`Fingerprint` (op, per-group sequence number, call site or ``annotate()``
name). Forensics compares them across ranks through the c10d store, which still works when the
collective transport is wedged.

*Watchdog* (:func:`arm`, called on every rank by ``init_distributed`` or by hand): one daemon
thread per process wakes every ``poll_s`` (1 s). The hot path is untouched: the thread reads
``TRACKER.in_flight`` under its lock and does one ``store.check`` of the current incident's
trigger key.

*Incident*: when a call this rank is blocked in (a sync op, or an async op inside ``wait()``) is
older than the forensics timeout, the watchdog sets the trigger key ``{gen}/{k}/trigger``. Every
watchdog that sees the trigger (including on ranks not in any collective: sleeping, computing, or
stuck elsewhere) publishes its state under ``{gen}/{k}/state/{rank}``: the call it is blocked in,
else its last one, plus its main thread's stack; and prints all its threads' stacks to its own
stderr. After every rank has published, or ``grace_s`` (3 s) has passed, each rank builds the same
one-sentence diagnosis, e.g. ``rank 3 is in all_gather #1042 (layers.7.mlp) while ranks 0-2 are
in reduce_scatter #1042 (layers.7.attn)``. Ranks with the same state are merged into ranges, the
smallest set (usually the odd one out) comes first, and ranks that never published are named as
unresponsive (their watchdog could not run: process dead, or C code holding the GIL). The lowest
reporting rank prints the sentence. ``gen`` (how many times this rank has armed on this store,
the same on every rank) keeps incidents of earlier arms on the same store apart; ``k`` counts
incidents.

*Failing the call*: the watchdog cannot interrupt a blocked op, so the default forensics timeout
is 90% of the call's process-group timeout: the diagnosis is ready when the backend gives up, and
the ``on_error`` hook turns the backend's timeout error (gloo raises ``RuntimeError: Timed out
waiting ...``; or "Connection closed by peer" when the other side timed out first and closed
the pair) into :class:`CollectiveTimeoutError` carrying the sentence. If the backend times out
before the forensics timeout, the hook starts the incident itself and waits for it. If a
diagnosed call is still blocked ``exit_grace_s`` (30 s) after its process-group timeout should
have fired (NCCL without async error handling, a wedged transport), the watchdog prints why and
ends the process with exit code 124 rather than hang forever.

Timeout precedence: ``arm(timeout_s=...)``, then the ``DS_COMM_TIMEOUT`` environment variable
(seconds), then 0.9 x the group's timeout (``init_process_group``/``new_group(timeout=...)``). A
shorter forensics timeout only diagnoses earlier; the call still fails at the group timeout.

Debug mode (``comms_logger.debug`` / ``configure(debug=True)``): before each collective the
members all-gather an 8-byte hash of ``Fingerprint.signature()`` (op, seq, group, dtype, shapes
unless they may differ per rank) with a raw torch op, so it is not itself tracked. On a mismatch
they all-gather the fingerprints and every rank raises :class:`CollectiveMismatchError` with the
same sentence before the mismatched op is issued, so nothing hangs. Point-to-point ops are not
checked (only two ranks take part). If a rank skipped the collective entirely, the check itself
blocks and the watchdog diagnoses it as above.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ds_comm._device_guard import group_device
from ds_comm._instrument import P2P_OPS, TRACKER, CallRecord, Fingerprint
from ds_comm.api import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ConfigError,
    DistributedEnvError,
)

__all__ = [
    "HANG_EXIT_CODE",
    "Incident",
    "arm",
    "describe_ranks",
    "disarm",
    "last_incident",
    "set_debug",
]

HANG_EXIT_CODE = 124  # like timeout(1): the process was ended because a collective never returned
_TIMEOUT_FRACTION = 0.9
_UNRESPONSIVE = "unresponsive"


# --- the sentence -------------------------------------------------------------------------------


def _ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    spans: list[list[int]] = []
    for r in sorted(ranks):
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def _clause(ranks: list[int], phrase: str) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]} is {phrase}"
    return f"ranks {_ranges(ranks)} are {phrase}"


def describe_ranks(phrases: Mapping[int, str], ranks: Iterable[int]) -> str:
    """One sentence saying what each of ``ranks`` is doing; ranks missing from ``phrases`` are unresponsive.

    Example:
        >>> describe_ranks({0: "in all_reduce #3 (a.py:1)", 1: "in all_reduce #3 (a.py:1)",
        ...                 2: "in barrier #3 (b.py:9)"}, range(4))
        'rank 2 is in barrier #3 (b.py:9) while ranks 0-1 are in all_reduce #3 (a.py:1) and rank 3 is unresponsive'
    """
    by_phrase: dict[str, list[int]] = {}
    for r in ranks:
        by_phrase.setdefault(phrases.get(r, _UNRESPONSIVE), []).append(r)
    groups = sorted(
        by_phrase.items(), key=lambda kv: (kv[0] == _UNRESPONSIVE, len(kv[1]), kv[1][0])
    )
    clauses = [_clause(rs, phrase) for phrase, rs in groups]
    if len(clauses) == 1:
        return clauses[0]
    rest = clauses[1:]
    tail = rest[0] if len(rest) == 1 else ", ".join(rest[:-1]) + " and " + rest[-1]
    return f"{clauses[0]} while {tail}"


# --- this rank's state --------------------------------------------------------------------------


def _blocked_call(flying: list[CallRecord]) -> CallRecord | None:
    """The call the issuing thread waits in (the newest blocking one), if any."""
    blocking = [rec for rec in flying if rec.blocking]
    return max(blocking, key=lambda rec: rec.start) if blocking else None


def _local_phrase() -> str:
    with TRACKER.lock:
        flying = list(TRACKER.in_flight.values())
        last = TRACKER.last
    rec = _blocked_call(flying)
    if rec is not None:
        return f"in {rec.fingerprint.describe()}"
    where = f"last: {last.fingerprint.describe()}" if last is not None else "none yet"
    if flying:
        where += f"; {len(flying)} async op(s) not waited on"
    return f"not in a collective ({where})"


def _format_stacks(only_main: bool = False) -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident() or (only_main and ident != main):
            continue  # the watchdog's own stack explains nothing
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"Thread {names.get(ident, ident)!r}:\n{stack}")
    return "\n".join(parts)


# --- the watchdog -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Incident:
    """One diagnosed hang as seen by this rank: the sentence and every reporting rank's state."""

    index: int
    time: float
    sentence: str
    states: dict[int, dict[str, Any]]


def _pg_timeout_s(group: Any | None) -> float:
    """The timeout the backend applies to ops on ``group`` (c10d's default if unknown)."""
    pg: Any = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout.total_seconds()
        except Exception:  # no backend for this device, or one without readable options
            continue
    return dist.default_pg_timeout.total_seconds()


class _Watchdog:
    """The per-process daemon thread described in [Note: hang forensics]."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timeout_s: float | None,
        *,
        poll_s: float,
        grace_s: float,
        exit_grace_s: float,
    ) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.grace_s = grace_s
        self.exit_grace_s = exit_grace_s
        # The n-th arm of every rank is generation n, however the ranks' arms interleave.
        self.gen = store.add(f"armed/{rank}", 1)
        self.incidents: list[Incident] = []
        self.cond = threading.Condition()
        # Set by a failing call (to its start time) to ask for a diagnosis if none covers it yet.
        self.force: float | None = None
        self.wake = threading.Event()
        self.stopped = threading.Event()
        # id(rec) -> (rec, exit deadline) for blocking calls already covered by an incident.
        self.covered: dict[int, tuple[CallRecord, float]] = {}
        self._pg_timeouts: dict[int, tuple[Any, float]] = {}
        self.thread = threading.Thread(target=self._run, name="ds_comm-hang-watchdog", daemon=True)
        self.thread.start()

    def _key(self, name: str) -> str:
        return f"{self.gen}/{len(self.incidents)}/{name}"

    def _pg_timeout(self, rec: CallRecord) -> float:
        cached = self._pg_timeouts.get(id(rec.group))
        if cached is None or cached[0] is not rec.group:
            cached = self._pg_timeouts[id(rec.group)] = (rec.group, _pg_timeout_s(rec.group))
        return cached[1]

    def _timeout(self, rec: CallRecord) -> float:
        if self.timeout_s is not None:
            return self.timeout_s
        return _TIMEOUT_FRACTION * self._pg_timeout(rec)

    def _run(self) -> None:
        while not self.stopped.is_set():
            self.wake.wait(self.poll_s)
            self.wake.clear()
            if self.stopped.is_set():
                return
            try:
                self._tick()
            except Exception as exc:  # the store went away (group destroyed without disarm)
                print(
                    f"[ds_comm rank {self.rank}] hang forensics disabled: {exc!r}",
                    file=sys.stderr,
                    flush=True,
                )
                return

    def _tick(self) -> None:
        now = time.perf_counter()
        with TRACKER.lock:
            flying = [rec for rec in TRACKER.in_flight.values() if rec.blocking]
        self._exit_if_still_blocked(flying, now)
        stuck = any(
            id(rec) not in self.covered and now - rec.start > self._timeout(rec) for rec in flying
        )
        with self.cond:
            since, self.force = self.force, None
            forced = since is not None and not any(i.time >= since for i in self.incidents)
        trigger = self._key("trigger")
        if stuck or forced:
            if not self.store.check([trigger]):
                self.store.set(trigger, str(self.rank))
            self._handle_incident()
        elif self.store.check([trigger]):
            self._handle_incident()

    def _handle_incident(self) -> None:
        start = time.perf_counter()
        state = {"rank": self.rank, "phrase": _local_phrase(), "stack": _format_stacks(True)}
        self.store.set(self._key(f"state/{self.rank}"), json.dumps(state))
        print(
            f"[ds_comm rank {self.rank}] hang diagnosis: this rank is {state['phrase']}; "
            f"stacks of all threads:\n{_format_stacks()}",
            file=sys.stderr,
            flush=True,
        )
        with TRACKER.lock:
            flying = [rec for rec in TRACKER.in_flight.values() if rec.blocking]
        for rec in flying:
            # The backend should raise at the group timeout; allow exit_grace_s beyond that.
            late = max(self._pg_timeout(rec) - (start - rec.start), 0.0) + self.exit_grace_s
            self.covered.setdefault(id(rec), (rec, start + late))
        keys = [self._key(f"state/{r}") for r in range(self.world_size)]
        while time.perf_counter() - start < self.grace_s and not self.store.check(keys):
            time.sleep(min(0.1, self.poll_s))
        states = {
            r: json.loads(self.store.get(k)) for r, k in enumerate(keys) if self.store.check([k])
        }
        sentence = describe_ranks(
            {r: s["phrase"] for r, s in states.items()}, range(self.world_size)
        )
        if self.rank == min(states):
            print(f"[ds_comm] hang diagnosis: {sentence}", file=sys.stderr, flush=True)
        with self.cond:
            self.incidents.append(Incident(len(self.incidents), start, sentence, states))
            self.cond.notify_all()

    def _exit_if_still_blocked(self, flying: list[CallRecord], now: float) -> None:
        alive = {id(rec) for rec in flying}
        for key, (rec, deadline) in list(self.covered.items()):
            if key not in alive:
                del self.covered[key]
            elif now > deadline:
                sentence = self.incidents[-1].sentence if self.incidents else "?"
                print(
                    f"[ds_comm rank {self.rank}] {rec.fingerprint.describe()} is still blocked "
                    f"{now - rec.start:.0f} s after it started, past its process-group timeout; "
                    f"exiting with code {HANG_EXIT_CODE}. Diagnosis: {sentence}",
                    file=sys.stderr,
                    flush=True,
                )
                sys.stdout.flush()
                os._exit(HANG_EXIT_CODE)

    def incident_during(self, rec: CallRecord) -> Incident | None:
        """The diagnosis of a hang that hit ``rec``; starts one (and waits for it) if none ran."""

        def find() -> Incident | None:
            return next((i for i in reversed(self.incidents) if i.time >= rec.start), None)

        deadline = time.perf_counter() + self.grace_s + 2 * self.poll_s + 2.0
        with self.cond:
            if find() is None:
                self.force = rec.start
                self.wake.set()
            while (found := find()) is None and self.thread.is_alive():
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    return None
                self.cond.wait(min(remaining, self.poll_s))
            return found

    def stop(self) -> None:
        self.stopped.set()
        self.wake.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=self.grace_s + 2 * self.poll_s + 1.0)


_WATCHDOG: _Watchdog | None = None


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def _translate_timeout(rec: CallRecord, exc: BaseException) -> None:
    """``on_error`` hook: a backend timeout becomes a CollectiveTimeoutError saying who is where.

    Any other backend error of a call already diagnosed as hung is translated too: gloo closes a
    pair when one side times out, so the peer often sees "Connection closed by peer" first.
    """
    watchdog = _WATCHDOG
    if watchdog is None or isinstance(exc, CollectiveTimeoutError):
        return
    if not isinstance(exc, RuntimeError):
        return
    if not _is_timeout(exc) and id(rec) not in watchdog.covered:
        return
    incident = watchdog.incident_during(rec)
    if incident is None:
        return
    raise CollectiveTimeoutError(
        f"{incident.sentence} [rank {watchdog.rank}: {rec.fingerprint.describe()} timed out "
        f"after {time.perf_counter() - rec.start:.1f} s; each rank printed its stacks to stderr]"
    ) from exc


def arm(
    timeout_s: float | None = None,
    *,
    store: Any | None = None,
    poll_s: float = 1.0,
    grace_s: float = 3.0,
    exit_grace_s: float = 30.0,
) -> None:
    """Start hang forensics on this rank; every rank of the default group must call it.

    Args:
        timeout_s: seconds a blocked call may take before ranks are asked where they are;
            default ``$DS_COMM_TIMEOUT``, else 90% of the call's process-group timeout.
        store: the c10d store shared by all ranks; default the default group's store.
        poll_s: watchdog period (one ``store.check`` per period when idle).
        grace_s: how long to wait for every rank's state once a hang is detected.
        exit_grace_s: how long past its group timeout a diagnosed call may stay blocked before
            the process exits with :data:`HANG_EXIT_CODE`.

    Example:
        >>> dist.init_process_group("gloo", timeout=timedelta(minutes=5))
        >>> ds_comm._forensics.arm()   # diagnoses hangs after 4.5 minutes
    """
    global _WATCHDOG
    if not dist.is_initialized():
        raise DistributedEnvError("hang forensics needs an initialised default process group")
    env = os.environ.get("DS_COMM_TIMEOUT")
    if timeout_s is None and env:
        try:
            timeout_s = float(env)
        except ValueError:
            raise ConfigError(f"DS_COMM_TIMEOUT={env!r}: expected seconds, e.g. 300") from None
    for name, value in {"timeout_s": timeout_s, "poll_s": poll_s, "grace_s": grace_s}.items():
        if value is not None and not value > 0:
            raise ConfigError(f"hang forensics {name} = {value!r}: expected a positive number")
    disarm()
    base = store if store is not None else dist.distributed_c10d._get_default_store()
    prefixed = dist.PrefixStore("ds_comm/forensics", base)
    _WATCHDOG = _Watchdog(
        prefixed,
        dist.get_rank(),
        dist.get_world_size(),
        timeout_s,
        poll_s=poll_s,
        grace_s=grace_s,
        exit_grace_s=exit_grace_s,
    )
    if _translate_timeout not in TRACKER.on_error:
        TRACKER.on_error.append(_translate_timeout)


def ensure_armed() -> None:
    """Arm with the defaults unless already armed (``init_distributed`` calls this on every rank)."""
    if _WATCHDOG is None:
        arm()


def disarm() -> None:
    """Stop the watchdog (call before destroying the default group); a no-op when not armed."""
    global _WATCHDOG
    watchdog, _WATCHDOG = _WATCHDOG, None
    if _translate_timeout in TRACKER.on_error:
        TRACKER.on_error.remove(_translate_timeout)
    if watchdog is not None:
        watchdog.stop()


def last_incident() -> Incident | None:
    """The most recent hang diagnosis on this rank since :func:`arm`, if any."""
    watchdog = _WATCHDOG
    return watchdog.incidents[-1] if watchdog is not None and watchdog.incidents else None


# --- debug mode: check fingerprints before every collective -------------------------------------


def _signature_hash(fp: Fingerprint) -> int:
    digest = hashlib.blake2b(repr(fp.signature()).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _detailed(fp: Fingerprint) -> str:
    shapes = "/".join("[" + ", ".join(map(str, s)) + "]" for s in fp.shapes)
    return f"in {fp.describe()} on {fp.dtype} {shapes}"


def _check_fingerprints(rec: CallRecord) -> None:
    """``on_begin`` hook in debug mode: raise on every rank if the group disagrees on this call."""
    if rec.op in P2P_OPS or len(rec.ranks) < 2:
        return
    fp = rec.fingerprint
    group = rec.group
    device = group_device(group)
    mine = torch.tensor([_signature_hash(fp)], dtype=torch.int64, device=device)
    everyone = torch.empty(len(fp.group), dtype=torch.int64, device=device)
    rec.blocking = True  # even for an async op, this thread now waits in the check
    dist.all_gather_into_tensor(everyone, mine, group=group)
    rec.blocking = not rec.async_op
    if bool((everyone == mine).all()):
        rec.start = time.perf_counter()  # bill the check to debug mode, not to the op's latency
        return
    fingerprints: list[Any] = [None] * len(fp.group)
    dist.all_gather_object(fingerprints, fp, group=group)
    phrases = {fp.group[i]: _detailed(f) for i, f in enumerate(fingerprints)}
    sentence = describe_ranks(phrases, fp.group)
    raise CollectiveMismatchError(f"{sentence} (debug check; the op was not issued)")


def set_debug(enabled: bool) -> None:
    """Install or remove the debug-mode fingerprint check (``configure(debug=...)`` calls this)."""
    if enabled and _check_fingerprints not in TRACKER.on_begin:
        TRACKER.on_begin.insert(0, _check_fingerprints)  # before the logger starts its clock
    elif not enabled and _check_fingerprints in TRACKER.on_begin:
        TRACKER.on_begin.remove(_check_fingerprints)
