"""Wire bytes per collective kind from ds-comm's comms logger, for the benchmarks' tables.

The bytes are ``ds_comm.get_comms_logger().summary()``'s: per op, the bytes each rank puts on the
wire (``msg_bytes * (n - 1) / n``, twice that for an all-reduce: nccl-tests' bus factor; see
``ds_comm/_logger.py``). Each row is filed under its collective kind and under whether it ran over
all ``world`` ranks or within a smaller group (hpZ's or MiCS's groups, an expert-data-parallel
group).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce", "other")


def kind_of(op: str) -> str:
    """The collective kind of a logged op name (variants such as ``all_gather_into_tensor``,
    ``reduce_scatter_tensor`` or ``all_to_all_single`` matched by substring)."""
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        if kind in op:
            return kind
    if "all_reduce" in op or "allreduce" in op:
        return "all_reduce"
    return "other"


def wire_bytes(summary: Iterable[Any], world: int) -> dict[str, dict[str, float]]:
    """``{kind: {"world": bytes, "group": bytes}}``: the wire bytes of ``summary``'s rows (ds-comm
    ``SummaryRow``s) by kind, over all ``world`` ranks and within smaller groups."""
    out = {kind: {"world": 0.0, "group": 0.0} for kind in KINDS}
    for row in summary:
        scope = "world" if row.group_size == world else "group"
        out[kind_of(row.op)][scope] += row.wire_bytes
    return out


def per_kind(summary: Iterable[Any], world: int) -> dict[str, float]:
    """``{kind: bytes}``: :func:`wire_bytes` with the world and smaller-group parts added up
    (tools/bench/autotp.py and ulysses.py show each kind's total)."""
    return {kind: sum(scopes.values()) for kind, scopes in wire_bytes(summary, world).items()}
