"""Comms logging: size, latency, algorithm and bandwidth of every collective (``comms_logger``).

Bandwidths follow the nccl-tests conventions (``doc/PERFORMANCE.md`` there): ``algbw`` is
``msg_bytes / latency`` and ``busbw = algbw * factor``, where the factor makes numbers comparable
with the link speed: ``2(n-1)/n`` for all_reduce; ``(n-1)/n`` for all_gather, reduce_scatter,
all_to_all, gather and scatter; 1 for broadcast, reduce, point-to-point, barrier and unknown ops (n = group size).
``msg_bytes * factor`` is also the bytes each rank puts on the wire, which is what compressed
communication is judged by (:meth:`CommsLogger.total_wire_bytes`). Latency runs from issuing the
op to its completion: for async ops that is the handle's ``wait()``, so overlapped compute counts.

When logging is disabled no hook is installed, so a collective costs only the bookkeeping that
``_instrument.tracked`` always does. The debug fingerprint check is configured here too (it is
part of DeepSpeed's ``comms_logger`` section) but lives in ``_forensics.py``.
"""

from __future__ import annotations

import collections
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import torch.distributed as dist

from ds_comm import _forensics
from ds_comm._instrument import TRACKER, CallRecord
from ds_comm.accelerator import get_accelerator
from ds_comm.api import CommsLoggerConfig

__all__ = [
    "CommsLogger",
    "OpRecord",
    "SummaryRow",
    "configure",
    "get_comm_operation_count",
    "get_comms_logger",
    "get_logged_comm_ops",
    "has_comm_data",
    "log_summary",
    "reset_log",
    "summary_dict",
]

_MAX_RECORDS = 10_000


def bus_factor(op: str, n: int) -> float:
    """nccl-tests bus-bandwidth factor of ``op`` on a group of ``n`` ranks.

    Matched by substring so variants (``all_gather_into_tensor``, ``reduce_scatter_tensor``,
    ``all_to_all_single``, a wrapper's ``compressed_all_reduce``) get their base op's factor.
    """
    if n <= 1:
        return 0.0
    if "all_reduce" in op or "allreduce" in op:
        return 2.0 * (n - 1) / n
    if any(kind in op for kind in ("gather", "scatter", "all_to_all")):
        return (n - 1) / n
    return 1.0


class OpRecord(NamedTuple):
    """One completed, logged call. Bandwidths are in bytes per second.

    A NamedTuple rather than a frozen dataclass: it is built on every logged call and constructs
    several times faster.
    """

    op: str
    seq: int
    site: str
    msg_bytes: int
    group_size: int
    algo: str
    latency_s: float
    algbw: float
    busbw: float
    wire_bytes: float


@dataclass(frozen=True)
class SummaryRow:
    """Aggregate of the calls sharing op, message size, algorithm and group size."""

    op: str
    msg_bytes: int
    algo: str
    group_size: int
    count: int
    total_latency_s: float
    algbw: float
    busbw: float
    wire_bytes: float

    @property
    def avg_latency_s(self) -> float:
        return self.total_latency_s / self.count


class _Aggregate:
    __slots__ = ("count", "latency_s", "wire_bytes")

    def __init__(self) -> None:
        self.count = 0
        self.latency_s = 0.0
        self.wire_bytes = 0.0


class CommsLogger:
    """Process-wide recorder behind ``comms_logger`` (one per process, like DeepSpeed's).

    ``records`` keeps the last 10,000 calls; the aggregates behind :meth:`summary` and
    :meth:`total_wire_bytes` cover every call since the last :meth:`reset`.
    """

    def __init__(self) -> None:
        self.config = CommsLoggerConfig()
        self.records: collections.deque[OpRecord] = collections.deque(maxlen=_MAX_RECORDS)
        self._aggregates: dict[tuple[str, int, str, int], _Aggregate] = {}
        self._only: frozenset[str] | None = None

    def reset(self) -> None:
        """Forget every record and aggregate (the configuration stays)."""
        self.records.clear()
        self._aggregates.clear()

    def record(self, rec: CallRecord) -> None:
        """Log one completed call (the ``on_end`` hook)."""
        fp = rec.fingerprint
        if self._only is not None and fp.op not in self._only:
            return
        if rec.device != "cpu":
            # The op may still be running on its stream: wait for it so latency is real.
            get_accelerator().synchronize()
            rec.end = time.perf_counter()
        latency = max(rec.latency_s, 1e-9)
        n = len(fp.group)
        factor = bus_factor(fp.op, n)
        algbw = rec.msg_bytes / latency
        wire = rec.msg_bytes * factor
        row = OpRecord(
            fp.op, fp.seq, fp.site, rec.msg_bytes, n, rec.algo, latency, algbw, algbw * factor, wire
        )
        self.records.append(row)
        agg = self._aggregates.get((fp.op, rec.msg_bytes, rec.algo, n))
        if agg is None:
            agg = self._aggregates[(fp.op, rec.msg_bytes, rec.algo, n)] = _Aggregate()
        agg.count += 1
        agg.latency_s += latency
        agg.wire_bytes += wire
        if self.config.verbose:
            print(f"[Rank {_rank()}] {_format_record(row)}", flush=True)

    def summary(self) -> list[SummaryRow]:
        """Aggregated rows sorted by op and message size (nccl-tests bandwidths, bytes/s)."""
        rows = []
        for (op, size, algo, n), agg in sorted(self._aggregates.items()):
            algbw = size * agg.count / agg.latency_s
            rows.append(
                SummaryRow(
                    op,
                    size,
                    algo,
                    n,
                    agg.count,
                    agg.latency_s,
                    algbw,
                    algbw * bus_factor(op, n),
                    agg.wire_bytes,
                )
            )
        return rows

    def total_wire_bytes(self, op: str | None = None) -> float:
        """Bytes this rank sent on the wire (``msg_bytes * busbw factor``), for ``op`` or all ops."""
        return sum(
            agg.wire_bytes for key, agg in self._aggregates.items() if op is None or key[0] == op
        )


_LOGGER = CommsLogger()


def _begin_on_device(rec: CallRecord) -> None:
    # Start the clock after earlier queued kernels finish, so they are not billed to this op.
    if rec.device != "cpu":
        get_accelerator().synchronize()
        rec.start = time.perf_counter()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.2f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def _format_record(row: OpRecord) -> str:
    return (
        f"comm op: {row.op} #{row.seq} ({row.site}) | algo: {row.algo} | ranks: {row.group_size} "
        f"| msg size: {_size(row.msg_bytes)} | time (ms): {row.latency_s * 1e3:.3f} "
        f"| algbw (GB/s): {row.algbw / 1e9:.3f} | busbw (GB/s): {row.busbw / 1e9:.3f}"
    )


def _install(hooks: list[Any], hook: Any, wanted: bool) -> None:
    if wanted and hook not in hooks:
        hooks.append(hook)
    elif not wanted and hook in hooks:
        hooks.remove(hook)


def configure(
    config: CommsLoggerConfig | Mapping[str, Any] | None = None,
    *,
    enabled: bool | None = None,
    verbose: bool | None = None,
    prof_all: bool | None = None,
    prof_ops: list[str] | tuple[str, ...] | None = None,
    debug: bool | None = None,
    deepspeed_config: Mapping[str, Any] | None = None,
) -> CommsLoggerConfig:
    """Configure comms logging and the debug fingerprint check (DeepSpeed's ``comms_logger``).

    ``config`` is a :class:`CommsLoggerConfig`, the ``comms_logger`` dict section, or a whole
    DeepSpeed config dict holding one; keyword arguments override it. Without ``config`` the
    keywords change the current settings. Returns the previous config, like ``numpy.seterr``,
    so a caller can restore it. ``deepspeed_config`` is DeepSpeed's keyword for ``config``.

    ``verbose`` prints one line per logged op on every rank, prefixed ``[Rank r]``: per-rank
    latencies are how a straggler shows. ``debug`` checks that all ranks agree on each
    collective before issuing it (one extra small all_gather per op; see ``_forensics.py``).

    Example:
        >>> previous = ds_comm.configure({"enabled": True, "prof_all": False,
        ...                               "prof_ops": ["all_reduce"]})
        >>> ...  # train
        >>> ds_comm.log_summary()
        >>> ds_comm.configure(previous)
    """
    if deepspeed_config is not None:
        if config is not None:
            raise TypeError("configure: pass config or deepspeed_config, not both")
        config = deepspeed_config
    if config is None:
        base = _LOGGER.config
    elif isinstance(config, CommsLoggerConfig):
        base = config
    else:
        section = config.get("comms_logger", config) if isinstance(config, Mapping) else config
        base = CommsLoggerConfig.from_dict(section)
    overrides = {
        "enabled": enabled,
        "verbose": verbose,
        "prof_all": prof_all,
        "prof_ops": prof_ops,
        "debug": debug,
    }
    new = replace(base, **{k: v for k, v in overrides.items() if v is not None})
    previous, _LOGGER.config = _LOGGER.config, new
    _LOGGER._only = None if new.prof_all else frozenset(new.prof_ops)
    _install(TRACKER.on_end, _LOGGER.record, new.enabled)
    on_device = get_accelerator().device_name() != "cpu"
    _install(TRACKER.on_begin, _begin_on_device, new.enabled and on_device)
    _forensics.set_debug(new.debug)
    return previous


def get_comms_logger() -> CommsLogger:
    """The process's :class:`CommsLogger` (records, :meth:`~CommsLogger.summary`, wire bytes)."""
    return _LOGGER


def _format_table(rows: list[SummaryRow], spread: Mapping[Any, tuple[float, float]] | None) -> str:
    header = [
        "op",
        "msg size",
        "algo",
        "ranks",
        "count",
        "total (ms)",
        "avg (ms)",
        "algbw (GB/s)",
        "busbw (GB/s)",
    ]
    if spread is not None:
        header += ["min avg (ms)", "max avg (ms)", "straggler (ms)"]
    lines = [header]
    for row in rows:
        line = [
            row.op,
            _size(row.msg_bytes),
            row.algo,
            str(row.group_size),
            str(row.count),
            f"{row.total_latency_s * 1e3:.3f}",
            f"{row.avg_latency_s * 1e3:.3f}",
            f"{row.algbw / 1e9:.3f}",
            f"{row.busbw / 1e9:.3f}",
        ]
        if spread is not None:
            lo, hi = spread[(row.op, row.msg_bytes, row.algo, row.group_size)]
            line += [f"{lo * 1e3:.3f}", f"{hi * 1e3:.3f}", f"{(hi - lo) * 1e3:.3f}"]
        lines.append(line)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i < 3 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(line, widths))
        ).rstrip()
        for line in lines
    )


def _gather_spread(rows: list[SummaryRow]) -> dict[Any, tuple[float, float]]:
    """Min and max over ranks of each row's average latency (raw collective: not logged)."""
    mine = {(r.op, r.msg_bytes, r.algo, r.group_size): r.avg_latency_s for r in rows}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {key: (v, v) for key, v in mine.items()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    spread = {}
    for key in mine:
        values = [theirs[key] for theirs in everyone if key in theirs]
        spread[key] = (min(values), max(values))
    return spread


def log_summary(show_straggler: bool = False, return_dict: bool = False) -> Any:
    """Print (on rank 0) and return a table of logged ops per op and message size.

    Latencies are this rank's. With ``show_straggler`` every rank must call this (it all-gathers
    the per-row average latencies over the default group, untracked) and the table adds the
    min/max over ranks and their difference, the time the slowest rank cost the others.
    With ``return_dict`` the result is DeepSpeed's dictionary instead of the table (see
    :func:`summary_dict`); the table is still printed on rank 0.

    Example:
        >>> ds_comm.configure(enabled=True)
        >>> ...  # train
        >>> table = ds_comm.log_summary(show_straggler=True)
    """
    rows = _LOGGER.summary()
    spread = _gather_spread(rows) if show_straggler else None
    table = _format_table(rows, spread)
    if _rank() == 0:
        print(f"Comms summary (rank 0 latencies):\n{table}", file=sys.stdout, flush=True)
    return summary_dict(rows, spread) if return_dict else table


def summary_dict(
    rows: list[SummaryRow], spread: Mapping[Any, tuple[float, float]] | None = None
) -> dict[str, Any]:
    """DeepSpeed's ``log_summary(return_dict=True)`` layout of ``rows``.

    ``{"summary": {op: {msg_bytes: {count, total_latency_ms, avg_latency_ms, tput_avg_gbps,
    busbw_avg_gbps, msg_size_bytes, msg_size_str}}}, "straggler_analysis": ... or None,
    "metadata": {world_size, rank, timestamp}}``. Rows of one op and size run with different
    algorithms are merged. Bandwidths are Gbit/s as in DeepSpeed; averages are plain means (not
    DeepSpeed's 10%-trimmed ones). Straggler figures are per row: the fastest rank's average
    latency and this rank's excess over it.
    """
    import datetime

    merged: dict[str, dict[int, list[Any]]] = {}
    for row in rows:
        slot = merged.setdefault(row.op, {}).setdefault(row.msg_bytes, [0, 0.0, 0.0, 0.0, []])
        slot[0] += row.count
        slot[1] += row.total_latency_s
        slot[2] += row.algbw * row.count
        slot[3] += row.busbw * row.count
        slot[4].append(row)
    summary: dict[str, Any] = {}
    straggler: dict[str, Any] | None = {} if spread is not None else None
    for op, sizes in merged.items():
        summary[op] = {}
        for size, (count, total_s, algbw, busbw, parts) in sorted(sizes.items()):
            summary[op][size] = {
                "count": count,
                "total_latency_ms": total_s * 1e3,
                "avg_latency_ms": total_s * 1e3 / count,
                "tput_avg_gbps": algbw / count * 8 / 1e9,
                "busbw_avg_gbps": busbw / count * 8 / 1e9,
                "msg_size_bytes": size,
                "msg_size_str": _size(size),
            }
            if straggler is not None and spread is not None:
                fastest = sum(
                    spread[(r.op, r.msg_bytes, r.algo, r.group_size)][0] * r.count for r in parts
                )
                straggler.setdefault(op, {})[size] = {
                    "count": count,
                    "total_comm_lat_ms": fastest * 1e3,
                    "total_straggler_ms": max(total_s - fastest, 0.0) * 1e3,
                    "avg_comm_lat_ms": fastest * 1e3 / count,
                    "avg_straggler_ms": max(total_s - fastest, 0.0) * 1e3 / count,
                    "msg_size_bytes": size,
                    "msg_size_str": _size(size),
                }
    world = dist.get_world_size() if dist.is_initialized() else 1
    return {
        "summary": summary,
        "straggler_analysis": straggler,
        "metadata": {
            "world_size": world,
            "rank": _rank(),
            "timestamp": datetime.datetime.now().isoformat(),
        },
    }


def reset_log() -> None:
    """Forget everything logged so far (e.g. per-epoch summaries); the configuration stays."""
    _LOGGER.reset()


def has_comm_data() -> bool:
    """Whether any call has been logged since the last reset."""
    return bool(_LOGGER.summary())


def get_comm_operation_count() -> int:
    """Calls logged since the last reset, all ops together."""
    return sum(row.count for row in _LOGGER.summary())


def get_logged_comm_ops() -> list[str]:
    """Names of the ops logged since the last reset, e.g. ``["all_reduce", "broadcast"]``."""
    return sorted({row.op for row in _LOGGER.summary()})
