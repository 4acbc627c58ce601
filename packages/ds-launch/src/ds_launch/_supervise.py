"""Run a set of child processes to the end: stream their output line by line, stop them all when
one fails or a signal arrives, and leave no process behind.

The node agent supervises its ranks with this; the launcher supervises pdsh, ssh, mpirun or srun
with it.

[Note: no orphans]
Every child gets its own process group (so a group kill also reaches whatever it forked) and,
on Linux, ``PR_SET_PDEATHSIG`` (so the kernel signals it when the supervisor dies, SIGKILL
included). Stopping the job signals each child's group *and* every descendant found in
``/proc``: some tools move their own children out of the group (pdsh runs each ssh in a
session of its own, and a SIGTERMed pdsh leaves them running), and the pids found are signalled
again at the SIGKILL deadline even if their parent has gone. A forked watchdog, the reaper,
holds the read end of a pipe whose write end only the supervisor holds; it learns each child's
pid through the pipe, and when the pipe closes without a goodbye (the supervisor died, however)
it SIGKILLs those children's groups and descendants, which catches the grandchildren
``PDEATHSIG`` cannot. A child whose own teardown matters more than the kernel's (pdsh) gets no
``PDEATHSIG`` and is left to the reaper. On a normal exit the supervisor SIGKILLs whatever is
left in the groups itself, then tells the reaper to leave.

[Note: Ctrl-C within 5 s]
A Ctrl-C must clear every process of the job, on every node, within 5 s, also when ranks run
no Python handler (a rank inside a collective's C code ignores SIGINT and SIGTERM until it
returns). The signal is passed on at once: to the local ranks, to ``mpirun``/``srun`` (which
pass it to theirs), to each ``ssh`` (which exits and drops its connection), and pdsh's tree is
SIGKILLed (its ssh processes inherit pdsh's blocked SIGINT, so only SIGKILL stops them at once).
A remote agent whose connection has dropped gets SIGTERM from the kernel (its parent-death
signal) and stops its ranks. Whatever still runs ``--kill_grace`` seconds later is SIGKILLed,
locally by the launcher and remotely by each agent; the default grace, 3 s, keeps the whole
chain under 5 s (``tools/bench/launch.py --ctrl-c`` measures it per runner). Ranks that need
longer to exit cleanly get it with a larger ``--kill_grace``.

[Note: one thread]
Children are started from the main thread and everything runs in one ``selectors`` loop: pipes,
child exits and signals all arrive as readable file descriptors (``signal.set_wakeup_fd`` turns
SIGCHLD/SIGINT/SIGTERM into bytes on a pipe). One thread also matters for ``PDEATHSIG``: it fires
when the *thread* that forked the child exits, so children must never be started from a
short-lived thread.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from ds_launch._log import Console
from ds_launch._members import Members, WatchPolicy, parse_event
from ds_launch.api import LaunchError

PR_SET_PDEATHSIG = 1
TAIL_LINES = 20
# A line longer than this is written out in pieces rather than held back.
_MAX_PENDING = 1 << 16
# After the last child exits, how long to keep reading pipes its leftovers may still hold.
_DRAIN_S = 1.0
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True, kw_only=True)
class ChildSpec:
    """One child process.

    Attributes:
        name: how messages call it (``rank 3``, ``node 1 (worker-2)``).
        argv: its command.
        env: its whole environment (None: inherit).
        prefix: written before each of its output lines (``[rank3] ``).
        log_path: also write its output, unprefixed, to this file.
        cores: pin it to these cores.
        death_signal: what the kernel sends it when the supervisor dies (None: nothing; the
            reaper still kills it and its descendants).
        failure_line: called with each stderr line; a ``(exit code, description)`` result counts
            as a failure of the job (pdsh reports remote exit codes this way).
        stop_signal: what stops it when the job stops, whatever signal the job got (None: that
            signal). pdsh gets SIGKILL: its ssh processes block SIGINT and outlive a SIGTERMed
            pdsh, and only the dropped connections stop the remote agents (see
            [Note: Ctrl-C within 5 s]).
        members: the indexes of the members (see [Note: every member is seen]) this child
            carries: one node for ssh, every node for pdsh; None: the member at its own index.
        events: its stderr carries node agents' event lines, which are taken out of the output.
    """

    name: str
    argv: Sequence[str]
    env: Mapping[str, str] | None = None
    prefix: bytes = b""
    log_path: str | None = None
    cores: Sequence[int] | None = None
    death_signal: int | None = signal.SIGKILL
    failure_line: Callable[[bytes], tuple[int, str] | None] | None = None
    stop_signal: int | None = None
    members: tuple[int, ...] | None = None
    events: bool = False


@dataclass(frozen=True)
class ChildFailure:
    """The first failure: who, with which exit code, and its last lines of output."""

    name: str
    pid: int
    code: int
    tail: tuple[str, ...]
    prefix: str


@dataclass(frozen=True)
class Outcome:
    """How the job ended: the exit code to return, and why."""

    exit_code: int
    failure: ChildFailure | None
    signal: int | None


def shell_code(returncode: int) -> int:
    """A ``Popen.returncode`` as a shell reports it (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def describe_code(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


@functools.cache
def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux only)."""
    prctl = _prctl()
    return prctl is not None and prctl(PR_SET_PDEATHSIG, int(sig)) == 0


def _child_setup(
    parent: int, cores: Sequence[int] | None, death_signal: int | None
) -> Callable[[], None]:
    prctl = _prctl()  # resolved before the fork: no dlopen in the child

    def setup() -> None:
        os.setpgid(0, 0)
        if prctl is not None and death_signal is not None:
            prctl(PR_SET_PDEATHSIG, int(death_signal))
            if os.getppid() != parent:  # the supervisor died before the line above
                os._exit(128 + int(death_signal))
        if cores:
            os.sched_setaffinity(0, cores)

    return setup


def _writer(stream: IO[str]) -> Callable[[bytes], None]:
    """Unbuffered writes of whole lines to ``stream``'s file descriptor."""
    try:
        fd = stream.fileno()
        stream.flush()
    except (AttributeError, OSError, ValueError):
        buffer = getattr(stream, "buffer", None)

        def write_text(data: bytes) -> None:
            if buffer is not None:
                buffer.write(data)
            else:
                stream.write(data.decode(errors="replace"))
            stream.flush()

        return write_text

    def write(data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(fd, view) :]
        except BrokenPipeError:
            pass  # nobody reads the console any more; the job itself goes on

    return write


def descendants(roots: set[int]) -> set[int]:
    """Every live descendant of ``roots`` (not the roots), from ``/proc``; empty elsewhere."""
    if not roots:
        return set()
    children: dict[int, list[int]] = collections.defaultdict(list)
    try:
        entries = os.listdir("/proc")
    except OSError:
        return set()
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fd:
                stat = fd.read()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2 :].split()
        children[int(fields[1])].append(int(entry))
    found: set[int] = set()
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs. A zombie does not, and is left for its parent to reap (a
    ``Popen`` of the caller's would otherwise lose its exit status)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fd:
            stat = fd.read()
        return stat[stat.rfind(b")") + 2 :][:1] != b"Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def terminate_tree(pid: int, timeout: float = 30.0) -> None:
    """SIGTERM ``pid`` and all its descendants, then SIGKILL whichever still runs after
    ``timeout`` seconds (DeepSpeed's ``terminate_process_tree``)."""
    tree = {pid, *descendants({pid})}
    for member in tree:
        _kill_pid(member, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while (alive := {member for member in tree if _alive(member)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    for member in alive:
        _kill_pid(member, signal.SIGKILL)


def _pgid(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except OSError:
        return -1


def _kill_pid(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _killpg(pgid: int, sig: int) -> None:
    """Signal a process group; one that is already gone or empty is no error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


class _Reaper:
    """The watchdog of [Note: no orphans]."""

    def __init__(self) -> None:
        self._fd: int | None = None
        self._pid = 0

    def __enter__(self) -> _Reaper:
        if not hasattr(os, "fork"):
            return self
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the forked watchdog
            try:
                os.close(write_fd)
                _reaper_main(read_fd)
            finally:
                os._exit(0)
        os.close(read_fd)
        self._fd, self._pid = write_fd, pid
        return self

    def _send(self, message: str) -> None:
        if self._fd is not None:
            os.write(self._fd, message.encode())

    def watch(self, pgid: int) -> None:
        self._send(f"+{pgid}\n")

    def __exit__(self, *exc_info: object) -> None:
        if self._fd is None:
            return
        self._send("q\n")
        os.close(self._fd)
        self._fd = None
        os.waitpid(self._pid, 0)


def _reaper_main(fd: int) -> None:  # pragma: no cover - runs in the forked watchdog
    for sig in (*_FORWARDED, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_IGN if sig != signal.SIGCHLD else signal.SIG_DFL)
    devnull = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(devnull, std)
    # Hold nothing of the supervisor's open: its console pipes must close when it exits.
    os.closerange(3, fd)
    os.closerange(fd + 1, 1 << 16)
    roots: set[int] = set()
    pending = b""
    while True:
        data = os.read(fd, 4096)
        if not data:
            break
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line == b"q":
                os._exit(0)
            roots.add(int(line[1:]))
    for pid in descendants(roots) | roots:
        _kill_pid(pid, signal.SIGKILL)
    for pgid in roots:
        _killpg(pgid, signal.SIGKILL)


class _Wakeup:
    """Signals as bytes on a pipe (see [Note: one thread]); inactive outside the main thread."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.pending: list[int] = []
        self._fds: tuple[int, int] | None = None
        self._old: dict[int, object] = {}
        self._old_fd = -1

    def __enter__(self) -> _Wakeup:
        if threading.current_thread() is not threading.main_thread():
            return self
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        self._fds, self.fd = (read_fd, write_fd), read_fd
        self._old_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for sig in (*_FORWARDED, signal.SIGCHLD):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if signum != signal.SIGCHLD:
            self.pending.append(signum)

    def drain(self) -> None:
        try:
            while self.fd is not None and os.read(self.fd, 512):
                pass
        except BlockingIOError:
            pass

    def take(self) -> list[int]:
        taken, self.pending = self.pending, []
        return taken

    def __exit__(self, *exc_info: object) -> None:
        if self._fds is None:
            return
        for sig, handler in self._old.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        signal.set_wakeup_fd(self._old_fd)
        for fd in self._fds:
            os.close(fd)
        self._fds = self.fd = None


class _Child:
    def __init__(self, spec: ChildSpec, proc: subprocess.Popen, index: int) -> None:
        self.spec = spec
        self.proc = proc
        self.members = spec.members if spec.members is not None else (index,)
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.log = open(spec.log_path, "wb") if spec.log_path else None  # noqa: SIM115
        self.streams: list[_Stream] = []


class _Stream:
    def __init__(self, child: _Child, pipe: IO[bytes], write: Callable[[bytes], None]) -> None:
        self.child = child
        self.pipe = pipe
        self.fd = pipe.fileno()
        self.write = write
        self.pending = b""
        self.is_stderr = False
        os.set_blocking(self.fd, False)


class _Job:
    """One supervised run; see ``supervise``."""

    def __init__(
        self,
        specs: Sequence[ChildSpec],
        kill_grace: float,
        noun: str,
        console: Console,
        watch: WatchPolicy | None = None,
    ) -> None:
        self.specs = specs
        self.watch = watch or WatchPolicy(names=tuple(spec.name for spec in specs))
        self.members = Members(self.watch, time.monotonic())
        self.console = console
        self.kill_grace = kill_grace
        self.noun = noun
        self.children: list[_Child] = []
        self.live: list[_Child] = []
        self.selector = selectors.DefaultSelector()
        self.out = _writer(sys.stdout)
        self.err = _writer(sys.stderr)
        self.failure: ChildFailure | None = None
        self.signal: int | None = None
        self.kill_at: float | None = None
        self.open_streams = 0
        # Descendants outside the children's groups, found when stopping (see signal_all).
        self.escaped: set[int] = set()

    def notice(self, level: str, text: str) -> None:
        # Through the children's writer, so it never splits one of their lines.
        if self.console.enabled(level):
            self.err(f"{self.console.prefix}: {text}\n".encode())

    # -- starting ---------------------------------------------------------------------------

    def start(self, reaper: _Reaper) -> None:
        parent = os.getpid()
        for spec in self.specs:
            try:
                proc = subprocess.Popen(
                    list(spec.argv),
                    env=None if spec.env is None else dict(spec.env),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    preexec_fn=_child_setup(parent, spec.cores, spec.death_signal),
                )
            except (OSError, subprocess.SubprocessError) as exc:
                self.signal_all(signal.SIGKILL)
                for child in self.live:
                    child.proc.wait()
                raise LaunchError(f"cannot start {spec.name} ({spec.argv[0]}): {exc}") from None
            reaper.watch(proc.pid)
            child = _Child(spec, proc, len(self.children))
            self.children.append(child)
            self.live.append(child)
            for pipe, write, is_err in (
                (proc.stdout, self.out, False),
                (proc.stderr, self.err, True),
            ):
                assert pipe is not None  # the child was started with stdout/stderr=PIPE
                stream = _Stream(child, pipe, write)
                stream.is_stderr = is_err
                child.streams.append(stream)
                self.selector.register(stream.fd, selectors.EVENT_READ, stream)
                self.open_streams += 1
        # The clocks of [Note: every member is seen] start once every child runs.
        self.members = Members(self.watch, time.monotonic())

    # -- output -----------------------------------------------------------------------------

    def emit(self, stream: _Stream, data: bytes, *, final: bool = False) -> None:
        buf = stream.pending + data
        if not buf:
            return
        cut = len(buf) if final or len(buf) > _MAX_PENDING else buf.rfind(b"\n") + 1
        if cut == 0:
            stream.pending = buf
            return
        stream.pending = buf[cut:]
        lines = buf[:cut].split(b"\n")
        if lines[-1] == b"":
            lines.pop()
        child = stream.child
        if stream.is_stderr and child.spec.events:
            lines = [line for line in lines if not self.on_event(line)]
            if not lines:
                return
        prefix = child.spec.prefix
        stream.write(b"".join(prefix + line + b"\n" for line in lines))
        if child.log is not None:
            child.log.write(b"".join(line + b"\n" for line in lines))
            child.log.flush()
        child.tail.extend(line.decode(errors="replace") for line in lines)
        if stream.is_stderr and child.spec.failure_line is not None:
            for line in lines:
                found = child.spec.failure_line(line)
                if found is not None and found[0] != 0:
                    self.on_failure(child, found[0], found[1])

    def on_event(self, line: bytes) -> bool:
        """Take a node agent's event line (see [Note: every member is seen]); False if not one."""
        event = parse_event(line)
        if event is None:
            return False
        kind, index, code = event
        if kind == "up":
            self.members.mark_up(index)
            if 0 <= index < len(self.watch.names):
                self.notice("debug", f"{self.watch.names[index]} started its ranks")
        else:
            self.members.mark_ended(index, code, time.monotonic())
        return True

    def read(self, stream: _Stream) -> int:
        """Read once: the byte count, 0 at end of file (the stream is closed), -1 if empty."""
        try:
            data = os.read(stream.fd, 1 << 16)
        except BlockingIOError:
            return -1
        if data:
            self.emit(stream, data)
            return len(data)
        self.emit(stream, b"", final=True)
        self.selector.unregister(stream.fd)
        stream.pipe.close()
        stream.child.streams.remove(stream)
        self.open_streams -= 1
        return 0

    def drain(self, child: _Child) -> None:
        """Read what an exited child already wrote, without blocking (bounded: a grandchild
        may still be writing to the same pipe)."""
        for stream in list(child.streams):
            for _ in range(64):
                if self.read(stream) <= 0:
                    break

    # -- stopping ---------------------------------------------------------------------------

    def signal_all(self, sig: int) -> None:
        """Signal every live child's group and every descendant (see [Note: no orphans]), with
        the child's ``stop_signal`` instead of ``sig`` where it has one."""
        everyone = {child.proc.pid for child in self.live}
        by_signal: dict[int, set[int]] = collections.defaultdict(set)
        for child in self.live:
            chosen = child.spec.stop_signal if sig != signal.SIGKILL else None
            by_signal[chosen or sig].add(child.proc.pid)
        reached: set[int] = set()
        for chosen, roots in by_signal.items():
            escaped = {pid for pid in descendants(roots) if _pgid(pid) not in everyone}
            self.escaped |= escaped
            reached |= escaped
            for pgid in roots:
                _killpg(pgid, chosen)
            for pid in escaped:
                _kill_pid(pid, chosen)
        for pid in self.escaped - reached:  # their child has gone: they still get ``sig``
            _kill_pid(pid, sig)

    def stop(self, sig: int) -> None:
        self.signal_all(sig)
        if self.kill_at is None:
            self.kill_at = time.monotonic() + self.kill_grace

    def on_failure(self, child: _Child | None, code: int, what: str) -> None:
        if self.failure is not None or self.signal is not None:
            return  # a consequence of stopping the job, not a cause
        if child is None:  # the job as a whole (see [Note: every member is seen])
            self.failure = ChildFailure(what, 0, code, (), "")
        else:
            self.failure = ChildFailure(
                what, child.proc.pid, code, tuple(child.tail), child.spec.prefix.decode()
            )
        others = [c for c in self.live if c is not child]
        if others:
            count = f"{len(others)} other {self.noun}{'s' if len(others) > 1 else ''}"
            self.notice("error", f"{what}; stopping the {count}")
        self.stop(signal.SIGTERM)

    def on_signal(self, sig: int) -> None:
        if self.signal is None and self.failure is None:
            self.signal = sig
            name = signal.Signals(sig).name
            self.notice("warning", f"got {name}; passing it on to {len(self.live)} {self.noun}(s)")
            self.stop(sig)
        else:  # a second signal, or one during a shutdown: stop waiting
            self.signal_all(signal.SIGKILL)

    def reap(self) -> None:
        for child in list(self.live):
            returncode = child.proc.poll()
            if returncode is None:
                continue
            self.live.remove(child)
            self.drain(child)
            for member in child.members:
                self.members.mark_ended(member, shell_code(returncode), time.monotonic())
            if returncode != 0:
                what = f"{child.spec.name} (pid {child.proc.pid}) {describe_code(returncode)}"
                self.on_failure(child, shell_code(returncode), what)

    # -- the loop ---------------------------------------------------------------------------

    def loop(self, wakeup: _Wakeup) -> None:
        if wakeup.fd is not None:
            self.selector.register(wakeup.fd, selectors.EVENT_READ, None)
        drain_until: float | None = None
        while self.live or self.open_streams:
            now = time.monotonic()
            if not self.live:
                if drain_until is None:
                    self.cleanup_groups()
                    drain_until = now + _DRAIN_S
                elif now >= drain_until:
                    break
            timeout = 0.05 if wakeup.fd is None else None
            for deadline in (self.kill_at, drain_until, self.members.deadline()):
                if deadline is not None:
                    left = max(0.0, deadline - now)
                    timeout = left if timeout is None else min(timeout, left)
            for key, _ in self.selector.select(timeout):
                if key.data is None:
                    wakeup.drain()
                else:
                    self.read(key.data)
            for sig in wakeup.take():
                self.on_signal(sig)
            self.reap()
            if (what := self.members.check(time.monotonic())) is not None:
                self.on_failure(None, 1, what)
            if self.kill_at is not None and time.monotonic() >= self.kill_at:
                self.signal_all(signal.SIGKILL)
                self.kill_at = None
        self.cleanup_groups()

    def cleanup_groups(self) -> None:
        """SIGKILL whatever the children left in their process groups."""
        for child in self.children:
            _killpg(child.proc.pid, signal.SIGKILL)
        for pid in self.escaped:
            _kill_pid(pid, signal.SIGKILL)

    def close(self) -> None:
        for child in self.children:
            for stream in list(child.streams):
                self.emit(stream, b"", final=True)
                stream.pipe.close()
            if child.log is not None:
                child.log.close()
        self.selector.close()

    def outcome(self) -> Outcome:
        if self.failure is not None:
            return Outcome(self.failure.code, self.failure, self.signal)
        if self.signal is not None:
            return Outcome(128 + self.signal, None, self.signal)
        return Outcome(0, None, None)


def report_failure(outcome: Outcome, *, with_tail: bool, console: Console) -> None:
    """Print the first failure (level ``error``), with its last lines when ``with_tail``."""
    failure = outcome.failure
    if failure is None:
        return
    lines = [failure.name]
    if with_tail and failure.tail:
        lines[0] += f"; its last {len(failure.tail)} line(s):"
        lines += [f"    {failure.prefix}{line}" for line in failure.tail]
    elif with_tail:
        lines[0] += "; it printed nothing"
    console.error("\n".join(lines))


def supervise(
    specs: Sequence[ChildSpec],
    *,
    kill_grace: float,
    noun: str,
    console: Console,
    watch: WatchPolicy | None = None,
    on_started: Callable[[], None] | None = None,
) -> Outcome:
    """Start every child, forward their output, and wait until all have ended.

    The first child to exit non-zero (or flagged by its ``failure_line``), or a failure of the
    ``watch`` checks (a member that never started, one that exited 0 long before the others),
    fails the job: the others get SIGTERM, then SIGKILL after ``kill_grace`` seconds. SIGINT, SIGTERM and SIGHUP
    received meanwhile are passed on to every child the same way; a second one kills at once.

    Args:
        specs: the children, started in order.
        kill_grace: seconds between SIGTERM (or the forwarded signal) and SIGKILL.
        noun: what a child is, for messages (``rank``, ``node``).
        console: where the supervisor's own messages go, and at which level.
        watch: the start-up and early-exit checks of [Note: every member is seen] (None: the
            children are the members, and a clean exit is never a failure).
        on_started: called once every child has started (a node agent reports ``up`` there).

    Returns:
        The outcome: exit code 0 when every child exited 0, the first failure's code, or
        128 + N after signal N.

    Raises:
        LaunchError: a child could not be started (those already started are killed first).
    """
    job = _Job(specs, kill_grace, noun, console, watch)
    with _Reaper() as reaper, _Wakeup() as wakeup:
        try:
            job.start(reaper)
            if on_started is not None:
                on_started()
            job.loop(wakeup)
        finally:
            job.signal_all(signal.SIGKILL)
            job.cleanup_groups()
            for child in job.children:
                if child.proc.poll() is None:
                    child.proc.wait()
            job.close()
    return job.outcome()
