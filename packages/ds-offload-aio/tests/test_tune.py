"""ds-nvme-tune: the sweep, the table and the ``aio`` section it prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_offload_aio import AioConfig, ConfigError, TuneResult, tune
from ds_offload_aio._tune import main, parse_size, rank, sweep_configs


def test_parse_size() -> None:
    assert [parse_size(s) for s in ("4096", "128K", "1M", "1.5G", "2MiB", "3kb")] == [
        4096, 131072, 1 << 20, 3 << 29, 2 << 20, 3072,
    ]  # fmt: skip
    with pytest.raises(ValueError, match="'lots' is not a size"):
        parse_size("lots")


def test_sweep_is_the_product_of_the_lists() -> None:
    configs = sweep_configs({"block_size": ["256K"], "io_parallel": [1, 4], "queue_depth": [8]})
    assert len(configs) == 1 * 1 * 2 * 2 * 2  # single_submit and overlap_events keep defaults
    assert {c.intra_op_parallelism for c in configs} == {1, 4}
    assert {c.block_size for c in configs} == {262144}
    assert len(sweep_configs({})) == 3 * 3 * 4 * 2 * 2
    with pytest.raises(ConfigError, match="sweep key 'depth'"):
        sweep_configs({"depth": [1]})
    with pytest.raises(ConfigError, match="expected a non-empty list"):
        sweep_configs({"queue_depth": 8})  # type: ignore[dict-item]


def test_score_is_the_rate_of_a_write_plus_a_read() -> None:
    both = TuneResult(AioConfig(), read_gbps=2.0, write_gbps=1.0)
    assert both.score == pytest.approx(2 / (1 / 2.0 + 1 / 1.0))
    assert TuneResult(AioConfig(), read_gbps=None, write_gbps=1.5).score == pytest.approx(1.5)


def test_rank_prefers_overlap_events_unless_batching_is_clearly_faster() -> None:
    def result(overlap: bool, rate: float) -> TuneResult:
        return TuneResult(AioConfig(overlap_events=overlap), read_gbps=rate, write_gbps=rate)

    near_tie = [result(False, 1.03), result(True, 1.0), result(True, 0.5)]
    assert [r.score for r in rank(near_tie)] == pytest.approx([1.0, 1.03, 0.5])
    clearly = [result(True, 1.0), result(False, 1.2)]
    assert [r.config.overlap_events for r in rank(clearly)] == [False, True]


def test_tune_measures_every_config_and_cleans_up(tmp_path: Path) -> None:
    results = tune(tmp_path, 1 << 20, {"block_size": ["256K"], "queue_depth": [4, 16], "intra_op_parallelism": [1, 2],
                   "single_submit": [False], "overlap_events": [True]}, progress=False)  # fmt: skip
    assert len(results) == 4
    assert all(r.read_gbps and r.write_gbps and r.read_gbps > 0 for r in results)
    assert [r.score for r in results] == sorted((r.score for r in results), reverse=True)
    assert list(tmp_path.iterdir()) == []


def test_cli_prints_the_table_and_the_best_aio_section(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps({"block_size": ["64K", "256K"], "queue_depth": [4],
                                 "io_parallel": [2], "single_submit": [False]}))  # fmt: skip
    data_dir = tmp_path / "nvme"
    data_dir.mkdir()
    assert main(["--nvme_dir", str(data_dir), "--io_size", "2M", "--sweep_config", str(sweep),
                 "--loops", "2", "--no_read"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    table, _, best = out.partition("\nBest of 4 configurations")
    rows = table.splitlines()[2:]
    assert len(rows) == 4 and all(row.split()[-2] == "-" for row in rows)  # reads skipped
    section = json.loads(best[best.index("{") :])
    assert section["aio"].keys() == {"block_size", "queue_depth", "intra_op_parallelism",
                                     "single_submit", "overlap_events"}  # fmt: skip
    first = rows[0].split()
    assert [section["aio"]["block_size"], section["aio"]["queue_depth"]] == [
        int(first[0]),
        int(first[1]),
    ]
    assert AioConfig.from_dict(section["aio"]).intra_op_parallelism == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--no_read", "--no_write"], "leave nothing to measure"),
        (["--io_size", "big"], "'big' is not a size"),
        (["--sweep_config", '{"depth": [1]}'], "sweep key 'depth'"),
        (["--loops", "0"], "--loops 0"),
    ],
)
def test_cli_rejects_bad_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit):
        main(["--nvme_dir", str(tmp_path), *args])
    assert message in capsys.readouterr().err
