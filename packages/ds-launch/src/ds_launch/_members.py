"""Who must be running: every node must start within a time limit, and a rank (or node) that
ends cleanly while the others run fails the job after a grace period.

[Note: every member is seen]
A supervisor's *members* are what the job is made of: the ranks of a node agent, or the nodes
of a pdsh or ssh launch. The agent's members are its children, up as soon as they are started.
A launcher's members are the remote agents, which it cannot see start: each agent run with
``--report_events`` writes one line to stderr when its ranks are started and one when it ends
(``#ds-launch-event up|exit NODE_RANK CODE``); the launcher takes them out of the output stream
(pdsh prefixes them with the host, ssh does not) and tracks each node.

* **Start-up.** A node whose agent has not reported ``up`` within ``--node_start_timeout``
  seconds (default 180, far below the 30-minute rendezvous timeout the ranks would otherwise
  wait out) fails the job, and the message names each such node. An ssh that cannot connect
  exits 255 and is reported at once; the timeout catches the rest (a hanging connection, a
  ProxyCommand, a stuck ``.bashrc``, an agent that cannot start).
* **Early clean exit.** A member that exits 0 while others still run is normal for a moment
  (ranks finish a few milliseconds apart), a bug when it lasts: the others usually wait for it
  in a collective until their own timeout. When members still run ``--early_exit_grace``
  seconds (default 60: ranks tearing torch down on a loaded machine can take tens of seconds)
  after the first clean exit, the job fails, naming the member that ended and those still
  running.
  ``--allow_early_rank_exit`` turns this off (a rank 0 that evaluates alone after the others
  finished, a job whose ranks end on their own schedules).

MPI and Slurm runners start ranks themselves, without an agent: there the MPI launcher decides.
"""

from __future__ import annotations

from dataclasses import dataclass

EVENT_MARK = b"#ds-launch-event "
_KINDS = (b"up", b"exit")


def event_line(kind: str, node_rank: int, code: int = 0) -> str:
    """The line a node agent writes for the launcher (``kind`` is ``up`` or ``exit``)."""
    return f"{EVENT_MARK.decode()}{kind} {node_rank} {code}"


def parse_event(line: bytes) -> tuple[str, int, int] | None:
    """``(kind, node_rank, code)`` of an event line (anywhere in it: pdsh prefixes the host)."""
    at = line.find(EVENT_MARK)
    if at < 0:
        return None
    parts = line[at + len(EVENT_MARK) :].split()
    if len(parts) != 3 or parts[0] not in _KINDS:
        return None
    try:
        return parts[0].decode(), int(parts[1]), int(parts[2])
    except ValueError:
        return None


@dataclass(frozen=True, kw_only=True)
class WatchPolicy:
    """What a supervisor checks about its members (see [Note: every member is seen]).

    Attributes:
        names: each member's name for messages (``rank 3 on w1``, ``node 1 (w2)``).
        start_timeout: seconds for every member to report ``up``; None: members are up when
            their child process starts.
        early_exit_grace: seconds the others may still run after a member exited 0; None: a
            clean exit is never a failure.
        allow_flag: the option that allows early exits, named in the message.
        timeout_flag: the option that sets ``start_timeout``, named in the message.
    """

    names: tuple[str, ...]
    start_timeout: float | None = None
    early_exit_grace: float | None = None
    allow_flag: str = "--allow_early_rank_exit"
    timeout_flag: str = "--node_start_timeout"


class Members:
    """The state of each member, and the failure the policy finds (if any) at a given time."""

    def __init__(self, policy: WatchPolicy, now: float) -> None:
        self.policy = policy
        count = len(policy.names)
        self.up = [policy.start_timeout is None] * count
        self.ended: list[int | None] = [None] * count
        self.start_deadline = None if policy.start_timeout is None else now + policy.start_timeout
        self.first_clean: tuple[int, float] | None = None

    def mark_up(self, index: int) -> None:
        if 0 <= index < len(self.up):
            self.up[index] = True

    def mark_ended(self, index: int, code: int, now: float) -> None:
        if not 0 <= index < len(self.ended) or self.ended[index] is not None:
            return
        self.ended[index] = code
        if code == 0 and self.first_clean is None and self._running():
            self.first_clean = (index, now)

    def _running(self) -> list[int]:
        return [i for i, code in enumerate(self.ended) if code is None]

    def deadline(self) -> float | None:
        """The next time ``check`` may find a failure (None: nothing pending)."""
        times = []
        if self.start_deadline is not None and not all(self.up):
            times.append(self.start_deadline)
        grace = self.policy.early_exit_grace
        if self.first_clean is not None and grace is not None:
            times.append(self.first_clean[1] + grace)
        return min(times) if times else None

    def check(self, now: float) -> str | None:
        """A description of the policy's failure at ``now``, or None."""
        names = self.policy.names
        if self.start_deadline is not None and now >= self.start_deadline:
            late = [i for i, up in enumerate(self.up) if not up and self.ended[i] is None]
            self.start_deadline = None
            if late:
                listed = ", ".join(names[i] for i in late)
                return (
                    f"{listed} did not start within {self.policy.start_timeout:g} s (no word "
                    "from its node agent): check that the node is reachable and can run "
                    f"`python -m ds_launch.node`; {self.policy.timeout_flag} sets the limit"
                )
        grace = self.policy.early_exit_grace
        running = self._running()
        if self.first_clean is None or grace is None or not running:
            return None
        index, ended_at = self.first_clean
        if now < ended_at + grace:
            return None
        self.first_clean = None
        still = ", ".join(names[i] for i in running)
        return (
            f"{names[index]} exited with code 0 while {still} still ran {now - ended_at:.0f} s "
            "later; a rank that ends early usually leaves the others waiting for it in a "
            f"collective. Pass {self.policy.allow_flag} if ranks may finish at different times"
        )
