"""Comms logger: configuration, nccl-tests sizes and bandwidths, wire bytes, summary table."""

from __future__ import annotations

import contextlib
import io
import time

import pytest
import torch

import ds_comm
from ds_comm import _logger
from ds_comm._instrument import TRACKER
from ds_comm.api import CommsLoggerConfig, ConfigError
from ds_testing import run_on_ranks

# --- pure logic ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("op", "n", "expected"),
    [
        ("all_reduce", 4, 1.5),
        ("all_reduce", 2, 1.0),
        ("all_gather_into_tensor", 4, 0.75),
        ("reduce_scatter_tensor", 8, 0.875),
        ("all_to_all_single", 2, 0.5),
        ("broadcast", 4, 1.0),
        ("send", 2, 1.0),
        ("barrier", 4, 1.0),
        ("all_reduce", 1, 0.0),
    ],
)
def test_bus_factor_follows_nccl_tests(op: str, n: int, expected: float) -> None:
    assert _logger.bus_factor(op, n) == pytest.approx(expected)


def test_configure_merges_section_and_keywords_and_installs_hooks_only_when_enabled() -> None:
    logger = _logger.get_comms_logger()
    before = logger.config
    try:
        returned = ds_comm.configure(
            {"comms_logger": {"enabled": True, "prof_all": False}}, prof_ops=["all_reduce"]
        )
        assert returned == before  # the previous config, to restore later
        expected = CommsLoggerConfig(enabled=True, prof_all=False, prof_ops=("all_reduce",))
        assert logger.config == expected
        assert logger.record in TRACKER.on_end
        assert ds_comm.configure(verbose=True) == expected
        cfg = logger.config  # keywords alone change the current settings
        assert cfg.enabled and cfg.verbose and cfg.prof_ops == ("all_reduce",)
        ds_comm.configure(enabled=False)
        # Disabled means no hook at all, so tracked() does only its bookkeeping.
        assert TRACKER.on_end == [] and TRACKER.on_begin == []
        with pytest.raises(ConfigError, match="did you mean 'verbose'"):
            ds_comm.configure({"verbos": True})
    finally:
        ds_comm.configure(before)


# --- multi-rank ---------------------------------------------------------------------------------


def _logged_ops_body(rank: int, world_size: int, *, numel: int) -> dict:
    """Log a few ops and compare every figure with the nccl-tests formulas computed here."""
    logger = ds_comm.get_comms_logger()
    previous = ds_comm.configure(enabled=True, prof_all=True)
    logger.reset()
    try:
        x = torch.full((numel,), float(rank + 1))
        for _ in range(3):
            ds_comm.all_reduce(x)
        gathered = torch.empty(numel * world_size)
        ds_comm.all_gather_into_tensor(gathered, x)
        shard = torch.empty(numel)
        ds_comm.reduce_scatter_tensor(shard, gathered)

        n, elem = world_size, x.element_size()
        expected = {  # op -> (count, msg_bytes, factor) per nccl-tests
            "all_reduce": (3, numel * elem, 2 * (n - 1) / n),
            "all_gather_into_tensor": (1, numel * n * elem, (n - 1) / n),  # output size
            "reduce_scatter_tensor": (1, numel * n * elem, (n - 1) / n),  # input size
        }
        rows = {row.op: row for row in logger.summary()}
        assert set(rows) == set(expected), rows
        for op, (count, size, factor) in expected.items():
            row = rows[op]
            assert (row.count, row.msg_bytes, row.group_size) == (count, size, n), row
            assert row.total_latency_s > 0
            assert row.algbw == pytest.approx(size * count / row.total_latency_s)
            assert row.busbw == pytest.approx(row.algbw * factor)
            assert logger.total_wire_bytes(op) == pytest.approx(count * size * factor)
        for rec in logger.records:
            assert rec.busbw == pytest.approx(rec.algbw * expected[rec.op][2])
            assert rec.algbw == pytest.approx(rec.msg_bytes / rec.latency_s)
        assert [r.seq for r in logger.records if r.op == "all_reduce"] == sorted(
            r.seq for r in logger.records if r.op == "all_reduce"
        )
        total = sum(c * s * f for c, s, f in expected.values())
        assert logger.total_wire_bytes() == pytest.approx(total)

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            table = ds_comm.log_summary()
        assert "all_reduce" in table and "reduce_scatter_tensor" in table
        assert ("Comms summary" in out.getvalue()) == (rank == 0)  # printed on rank 0 only
        logger.reset()
        assert logger.summary() == [] and logger.total_wire_bytes() == 0
        return {"wire": total, "rows": len(rows)}
    finally:
        ds_comm.configure(previous)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_records_sizes_bandwidths_and_wire_bytes(world_size: int) -> None:
    results = run_on_ranks(_logged_ops_body, world_size, numel=256)
    assert all(r["rows"] == 3 for r in results)


def _filter_and_verbose_body(rank: int, world_size: int) -> dict:
    logger = ds_comm.get_comms_logger()
    previous = ds_comm.configure(
        {
            "enabled": True,
            "prof_all": False,
            "prof_ops": ["all_gather_into_tensor"],
            "verbose": True,
        }
    )
    logger.reset()
    try:
        x = torch.ones(8)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            ds_comm.all_reduce(x)
            ds_comm.all_gather_into_tensor(torch.empty(8 * world_size), x)
        lines = out.getvalue().splitlines()
        ops = [rec.op for rec in logger.records]
        return {"ops": ops, "lines": lines}
    finally:
        logger.reset()
        ds_comm.configure(previous)


def test_prof_ops_filters_and_verbose_prints_one_line_per_op_on_every_rank() -> None:
    results = run_on_ranks(_filter_and_verbose_body, 2)
    for rank, result in enumerate(results):
        assert result["ops"] == ["all_gather_into_tensor"]
        assert len(result["lines"]) == 1, result["lines"]
        line = result["lines"][0]
        assert line.startswith(f"[Rank {rank}] comm op: all_gather_into_tensor #")
        assert "msg size: 64 B" in line and "busbw (GB/s)" in line


def _straggler_body(rank: int, world_size: int) -> dict:
    logger = ds_comm.get_comms_logger()
    previous = ds_comm.configure(enabled=True)
    logger.reset()
    try:
        x = torch.ones(16)
        ds_comm.all_reduce(x)
        if rank == 0:
            time.sleep(0.5)  # rank 1 waits for rank 0 in the next all_reduce: it is slower there
        ds_comm.all_reduce(x)
        count_before = len(logger.records)
        table = ds_comm.log_summary(show_straggler=True)
        assert len(logger.records) == count_before  # the gather itself is not logged
        avg = logger.summary()[0].avg_latency_s
        return {"table": table, "avg": avg}
    finally:
        logger.reset()
        ds_comm.configure(previous)


def test_log_summary_with_straggler_shows_min_and_max_over_ranks() -> None:
    results = run_on_ranks(_straggler_body, 2)
    header, row = results[0]["table"].splitlines()[:2]
    assert "straggler (ms)" in header
    cells = row.split()
    lo, hi, spread = (float(c) for c in cells[-3:])
    avgs = [r["avg"] * 1e3 for r in results]
    assert lo == pytest.approx(min(avgs), abs=1e-3)
    assert hi == pytest.approx(max(avgs), abs=1e-3)
    assert spread == pytest.approx(hi - lo, abs=2e-3)
    assert hi - lo > 100  # rank 1 waited ~500 ms over two calls; rank 0 did not
