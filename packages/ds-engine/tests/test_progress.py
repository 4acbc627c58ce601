"""What rank 0 prints: the numerics contract, ``steps_per_print`` lines with loss, LR and
samples/s, and ``wall_clock_breakdown`` timings."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _engine_testing import config, loss_of, make_dataset, make_mlp

from ds_comm import ConfigError
from ds_engine import DeepSpeedConfig, numerics_table
from ds_engine._progress import Progress


def test_numerics_contract_names_every_dtype_and_the_reduction_order() -> None:
    cfg = DeepSpeedConfig.from_dict(
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 4,
            "fp16": {"enabled": True, "initial_scale_power": 12},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        },
        dp_world_size=2,
    )
    table = numerics_table(cfg)
    for row in (
        "parameters             float16",
        "gradient accumulation  float16, 4 micro-batches",
        "reductions             float16 over 2 data-parallel ranks",
        "master weights         float32 (host, offloaded)",
        "loss scaling           dynamic (2**12",
        "reduce-scatter per bucket every micro-batch",
        "sums, then divides by dp size",
    ):
        assert row in table
    tuned = numerics_table(
        DeepSpeedConfig.from_dict(
            {
                "train_batch_size": 4,
                "gradient_predivide_factor": 4.0,
                "communication_data_type": "bf16",
            }
        )
    )
    assert "reductions             bfloat16 over 1 data-parallel ranks" in tuned
    assert "divides by 4 before the sum, multiplies by 4/dp after" in tuned
    prescaled = numerics_table(
        DeepSpeedConfig.from_dict({"train_batch_size": 4, "prescale_gradients": True})
    )
    assert "each rank divides by dp size before the sum" in prescaled
    plain = numerics_table(DeepSpeedConfig.from_dict({"train_batch_size": 4}))
    assert "float32 (the parameters themselves)" in plain and "loss scaling           none" in plain


def test_progress_prints_every_steps_per_print_on_rank_zero_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    shown = Progress(rank=0, steps_per_print=2, interactive=False)
    hidden = Progress(rank=1, steps_per_print=2, interactive=False)
    for step in range(1, 5):
        for progress in (shown, hidden):
            progress.update(step=step, samples=8 * step, loss=1.0 / step, lr=1e-3, timers="")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["step 2", "step 4"]
    assert "loss=0.5000" in lines[0] and "lr=0.001" in lines[0] and "samples/s=" in lines[0]


def _logging_body(rank: int, world_size: int) -> str:
    import contextlib
    import io

    import ds_engine

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cfg = config(steps_per_print=2, wall_clock_breakdown=True)
        engine, *_ = ds_engine.initialize(model=make_mlp(), config=cfg)
        data = make_dataset(16)
        for step in range(4):
            engine.backward(loss_of(engine, [t[4 * step : 4 * step + 4] for t in data.tensors]))
            engine.step()
    return out.getvalue()


@pytest.mark.parametrize("world_size", [1, 2])
def test_engine_logs_contract_progress_and_timings(world_size: int) -> None:
    outputs = run_on_ranks(_logging_body, world_size)
    text = outputs[0]
    assert text.startswith("numerics contract")
    step_lines = [line for line in text.splitlines() if line.startswith("step ")]
    assert len(step_lines) == 2
    for part in ("loss=", "lr=", "samples/s="):
        assert part in step_lines[1]
    timer_lines = [line for line in text.splitlines() if "time (ms) | " in line]
    assert len(timer_lines) == 6  # DeepSpeed's micro, global and optimizer lines, twice
    for part in ("fwd_microstep:", "bwd:", "bwd_allreduce:", "step:", "optimizer_step:"):
        assert any(part in line for line in timer_lines[3:]), part
    assert all(out == "" for out in outputs[1:])


def test_throughput_timer_switches_the_samples_per_second_field(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for throughput, synchronized in [(True, True), (True, False), (False, True)]:
        progress = Progress(
            rank=0,
            steps_per_print=1,
            interactive=False,
            throughput=throughput,
            synchronized=synchronized,
        )
        progress.update(step=1, samples=8, loss=1.0, lr=1e-3, timers="")
        line = capsys.readouterr().out
        assert line.startswith("step 1: loss=1.0000, lr=0.001")
        assert ("samples/s=" in line) is throughput


def test_timers_section_is_typed_and_checked() -> None:
    default = DeepSpeedConfig.from_dict({"train_batch_size": 4})
    assert default.timers.throughput.enabled and default.timers.throughput.synchronized
    off = DeepSpeedConfig.from_dict(
        {"train_batch_size": 4, "timers": {"throughput": {"enabled": False, "synchronized": False}}}
    )
    assert not off.timers.throughput.enabled and not off.timers.throughput.synchronized
    with pytest.raises(ConfigError, match=r"timers.throughput.enabled = 'no': expected true"):
        DeepSpeedConfig.from_dict(
            {"train_batch_size": 4, "timers": {"throughput": {"enabled": "no"}}}
        )
    with pytest.raises(ConfigError, match="synchronised"):
        DeepSpeedConfig.from_dict(
            {"train_batch_size": 4, "timers": {"throughput": {"synchronised": True}}}
        )


def _throughput_off_body(rank: int, world_size: int) -> str:
    import contextlib
    import io

    import ds_engine

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cfg = config(steps_per_print=1, timers={"throughput": {"enabled": False}})
        engine, *_ = ds_engine.initialize(model=make_mlp(), config=cfg)
        data = make_dataset(8)
        for step in range(2):
            engine.backward(loss_of(engine, [t[4 * step : 4 * step + 4] for t in data.tensors]))
            engine.step()
    return out.getvalue()


def test_engine_honours_timers_throughput_enabled_false() -> None:
    text = run_on_ranks(_throughput_off_body, 1)[0]
    step_lines = [line for line in text.splitlines() if line.startswith("step ")]
    assert len(step_lines) == 2
    assert all("loss=" in line and "samples/s" not in line for line in step_lines)
