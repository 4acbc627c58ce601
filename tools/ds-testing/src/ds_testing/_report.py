"""Turn an :class:`~ds_testing._pool.Outcome` into a readable multi-rank failure message."""

from __future__ import annotations

import sys
from collections.abc import Iterable

from ds_testing._pool import Outcome, RankOutcome

_OUTPUT_TAIL_LINES = 60


def _ranks(outcomes: Iterable[RankOutcome]) -> list[int]:
    return [o.rank for o in outcomes]


def _tail(text: str, lines: int = _OUTPUT_TAIL_LINES) -> str:
    kept = text.rstrip("\n").splitlines()
    if len(kept) <= lines:
        return "\n".join(kept)
    return "\n".join([f"... ({len(kept) - lines} earlier lines omitted)", *kept[-lines:]])


def _section(title: str, body: str) -> str:
    return f"---- {title} ----\n{body.rstrip()}"


def format_failure(fn_name: str, world_size: int, outcome: Outcome) -> str:
    """Summary line, then per failed rank: what happened, its traceback or stack, its output."""
    by_status = {
        s: [o for o in outcome.ranks if o.status == s] for s in ("ok", "raised", "exited", "hung")
    }
    what = "start-up of the workers" if outcome.phase == "start-up" else f"{fn_name}"
    lines = [f"{what} failed on {world_size} rank(s):"]
    if by_status["raised"]:
        lines.append(f"  ranks {_ranks(by_status['raised'])} raised")
    for o in by_status["exited"]:
        lines.append(f"  rank {o.rank} {o.detail}")
    if by_status["hung"]:
        lines.append(f"  ranks {_ranks(by_status['hung'])} did not finish {outcome.hang_reason}")
    ok = _ranks(by_status["ok"])
    lines.append(f"  ranks {ok} succeeded" if ok else "  no rank succeeded")
    sections = ["\n".join(lines)]
    for o in outcome.ranks:
        if o.status == "raised":
            sections.append(_section(f"rank {o.rank} traceback", o.detail))
        elif o.status == "hung":
            sections.append(_section(f"rank {o.rank} stack (hung)", o.stack))
        elif o.status == "exited":
            sections.append(_section(f"rank {o.rank} {o.detail}", "(no Python traceback)"))
        if o.status != "ok" and o.output.strip():
            sections.append(_section(f"rank {o.rank} output (tail)", _tail(o.output)))
    return "\n".join(sections)


def forward_output(outcome: Outcome) -> None:
    """Write what each rank printed to this process's stderr, prefixed ``[rankN]``.

    pytest captures it per test and shows it under "Captured stderr" when the test fails.
    """
    for o in outcome.ranks:
        for line in o.output.splitlines():
            sys.stderr.write(f"[rank{o.rank}] {line}\n")
    sys.stderr.flush()
