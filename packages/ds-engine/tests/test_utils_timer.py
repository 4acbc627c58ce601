"""``deepspeed.utils.timer``, ``nvtx`` and ``module_utils``: timers measure what ran between
start and stop, the throughput meter counts samples after its warm-up steps, instrumented
functions appear as profiler ranges, dotted attribute access."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from ds_testing import run_on_ranks


def test_wall_clock_timers() -> None:
    from ds_engine.utils.timer import SynchronizedWallClockTimer, trim_mean

    timers = SynchronizedWallClockTimer()
    for _ in range(3):
        timers("sleep").start()
        time.sleep(0.02)
        timers("sleep").stop()
    with pytest.raises(RuntimeError, match="not started"):
        timers("sleep").stop()
    assert 15.0 <= timers("sleep").mean() <= 200.0
    total = timers("sleep").elapsed(reset=True)
    assert 55.0 <= total <= 600.0 and timers("sleep").elapsed() == 0.0
    timers("run").start()
    with pytest.raises(RuntimeError, match="already been started"):
        timers("run").start()
    assert timers("run").elapsed(reset=False) >= 0.0 and timers("run").started_
    assert set(timers.get_mean(["sleep", "run", "absent"])) == {"sleep", "run"}
    assert trim_mean([1.0, 2.0, 3.0, 100.0], 0.25) == 2.5 and trim_mean([], 0.1) == 0.0


def test_timer_log(capsys: pytest.CaptureFixture[str]) -> None:
    from ds_engine.utils.timer import NoopTimer, SynchronizedWallClockTimer

    timers = SynchronizedWallClockTimer()
    timers("fwd").start()
    timers("fwd").stop()
    timers.log(["fwd"], memory_breakdown=True)
    out = capsys.readouterr().out
    assert "time (ms) | fwd: " in out and "mem_allocated" in out
    noop = NoopTimer()
    noop("x").start()
    assert noop("x").elapsed() == 0.0 and noop.get_timers() == {}


def test_throughput_timer() -> None:
    from ds_engine.utils.timer import ThroughputTimer

    lines: list[str] = []
    meter = ThroughputTimer(
        SimpleNamespace(enabled=True, synchronized=True),
        batch_size=8,
        start_step=1,
        steps_per_output=2,
        logging_fn=lines.append,
    )
    assert meter.avg_samples_per_sec() == float("-inf")
    for _ in range(5):
        meter.start()
        time.sleep(0.01)
        meter.stop(global_step=True)
    assert meter.global_step_count == 5 and meter.micro_step_count == 5
    rate = meter.avg_samples_per_sec()
    assert 8 / 0.5 < rate < 8 / 0.009  # 8 samples per ~10 ms step
    assert len(lines) == 2 and "global_step=4" in lines[1] and "SamplesPerSec" in lines[1]
    off = ThroughputTimer(SimpleNamespace(enabled=False, synchronized=False), batch_size=8)
    off.start()
    off.stop(global_step=True)
    assert off.global_step_count == 0


def test_instrument_w_nvtx_records_a_range() -> None:
    from ds_engine.utils import instrument_w_nvtx

    @instrument_w_nvtx
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    from ds_comm.accelerator import get_accelerator

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        assert torch.equal(scaled(torch.ones(2)), torch.full((2,), 2.0))
    assert scaled.__name__ == "scaled"
    if get_accelerator().device_name() == "cpu":  # CUDA ranges go to NVTX, not the profiler
        names = {e.name for e in prof.events()}
        assert any("scaled" in n for n in names), sorted(names)[:20]


def test_recursive_attributes() -> None:
    from ds_engine.utils import recursive_getattr, recursive_setattr

    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    assert recursive_getattr(model, "0.0") is model[0][0]
    new = torch.nn.Linear(2, 3)
    recursive_setattr(model, "0.0", new)
    assert model[0][0] is new
    recursive_setattr(model, "extra", torch.nn.ReLU())
    assert isinstance(model.extra, torch.nn.ReLU)


def _breakdown_body(rank: int, world_size: int, stage: int) -> dict:
    import contextlib
    import io
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from _engine_testing import config, loss_of, make_dataset, make_mlp

    import ds_engine

    stdout = io.StringIO()
    cfg = config(
        wall_clock_breakdown=True,
        steps_per_print=2,
        gradient_accumulation_steps=2,
        zero_optimization={"stage": stage},
    )
    with contextlib.redirect_stdout(stdout):
        engine, *_ = ds_engine.initialize(model=make_mlp(), config=cfg)
        data = make_dataset(32)
        for micro in range(8):  # 4 optimizer steps of 2 micro-batches
            batch = [t[4 * micro : 4 * micro + 4] for t in data.tensors]
            engine.backward(loss_of(engine, batch))
            engine.step()
    return {"timers": engine.get_wall_clock_timers(), "stdout": stdout.getvalue()}


NAMES = {
    "optimizer": ["optimizer_allgather", "optimizer_gradients", "optimizer_step"],
    "micro": [
        "fwd_microstep",
        "bwd_microstep",
        "bwd_inner_microstep",
        "bwd_allreduce_microstep",
        "step_microstep",
    ],
    "global": ["fwd", "bwd", "bwd_inner", "bwd_allreduce", "step"],
}


@pytest.mark.parametrize("stage", [0, 2])
def test_wall_clock_breakdown_reports_every_timer_on_two_ranks(stage: int) -> None:
    outputs = run_on_ranks(_breakdown_body, 2, stage, timeout=300)
    every = [name for names in NAMES.values() for name in names]
    for out in outputs:
        timers = out["timers"]
        assert sorted(timers) == sorted(every)
        assert all(timers[name] > 0.0 for name in every), timers
        # the parts add up to the whole (the same two marks bound both)
        assert timers["bwd"] == pytest.approx(timers["bwd_inner"] + timers["bwd_allreduce"])
        phases = sum(timers[n] for n in NAMES["optimizer"])
        assert 0 < phases <= timers["step"]
    prefix = "[Rank 0] time (ms) | "
    lines = [ln for ln in outputs[0]["stdout"].splitlines() if ln.startswith(prefix)]
    assert len(lines) == 6  # DeepSpeed's optimizer, micro and global lines at steps 2 and 4
    for line, names in zip(lines[:3], NAMES.values()):
        assert [part.split(":")[0] for part in line.split(" | ")[1:]] == names
        assert all(float(part.split(": ")[1]) >= 0 for part in line.split(" | ")[1:]), line
    assert "time (ms)" not in outputs[1]["stdout"]  # printed on rank 0 only


def test_intervals_from_marks_and_fold() -> None:
    from ds_engine.utils.timer import SynchronizedWallClockTimer, timer_mark

    timers = SynchronizedWallClockTimer()
    for _ in range(3):
        start = timer_mark()
        time.sleep(0.01)
        timers("phase").add_interval(start, timer_mark())
    total = timers("phase").elapsed(reset=False)
    assert 25.0 <= total <= 600.0
    timers("phase").fold()
    assert timers("phase").elapsed(reset=False) == pytest.approx(total)
    assert timers("phase").elapsed_records is not None and len(timers("phase").elapsed_records) == 1
    with pytest.raises(TypeError, match="different kinds"):
        timers("phase").add_interval(0.0, object())
