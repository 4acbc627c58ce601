"""The pipeline engine's ``wall_clock_breakdown`` and progress line: DeepSpeed's pipeline timer
names and line formats, on two gloo ranks as two pipeline stages."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn

from ds_testing import run_on_ranks

DIM, ROWS, GAS = 4, 2, 2


def _body(rank: int, world_size: int, *, breakdown: bool, throughput: bool) -> dict[str, Any]:
    import contextlib
    import io

    import ds_engine
    from ds_comm import PipeDataParallelTopology
    from ds_pipe import LayerSpec, PipelineModule

    module = PipelineModule(
        [LayerSpec(nn.Linear, DIM, DIM), torch.tanh, LayerSpec(nn.Linear, DIM, 1)],
        topology=PipeDataParallelTopology(num_pp=2, num_dp=1),
        loss_fn=nn.functional.mse_loss,
        partition_method="uniform",
    )
    config = {
        "train_batch_size": ROWS * GAS,
        "train_micro_batch_size_per_gpu": ROWS,
        "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
        "steps_per_print": 2,
        "wall_clock_breakdown": breakdown,
        "timers": {"throughput": {"enabled": throughput}},
    }
    data = [(torch.randn(ROWS, DIM), torch.randn(ROWS, 1)) for _ in range(4 * GAS)]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        engine, *_ = ds_engine.initialize(config=config, model=module)
        it = iter(data)
        losses = [float(engine.train_batch(it)) for _ in range(4)]
    return {
        "timers": engine.get_wall_clock_timers(),
        "stdout": stdout.getvalue(),
        "losses": losses,
    }


MICRO = ["batch_input", "fwd_microstep", "bwd_microstep", "bwd_inner_microstep",
         "bwd_allreduce_microstep", "step_microstep"]  # fmt: skip
GLOBAL = ["fwd", "bwd", "bwd_inner", "bwd_allreduce", "step"]
PIPE = ["pipe_send_output", "pipe_send_grad", "pipe_recv_input", "pipe_recv_grad"]
# the transfers each stage of two runs (the first sends outputs and receives gradients)
STAGE_PIPE = [["pipe_send_output", "pipe_recv_grad"], ["pipe_recv_input", "pipe_send_grad"]]


def _names(line: str) -> list[str]:
    return [part.split(":")[0] for part in line.split(" | ")[1:]]


def test_pipeline_wall_clock_breakdown_names_every_timer() -> None:
    outputs = run_on_ranks(_body, 2, breakdown=True, throughput=True, timeout=120)
    for stage, out in enumerate(outputs):
        timers = out["timers"]
        expected = sorted([*MICRO, *GLOBAL, *STAGE_PIPE[stage], "train_batch"])
        assert sorted(timers) == expected, timers
        assert all(value > 0.0 for value in timers.values()), timers
        assert timers["bwd"] == pytest.approx(timers["bwd_inner"])
        assert timers["train_batch"] >= timers["fwd"] + timers["step"]
    lines = outputs[0]["stdout"].splitlines()
    timed = [ln for ln in lines if ln.startswith("[Rank 0] time (ms) | ")]
    assert len(timed) == 6  # three lines at steps 2 and 4
    assert [_names(ln) for ln in timed[:3]] == [MICRO, GLOBAL, STAGE_PIPE[0]]
    for line in timed:
        assert all(float(part.split(": ")[1]) >= 0 for part in line.split(" | ")[1:]), line
    progress = [ln for ln in lines if ln.startswith("steps: ")]
    pattern = r"steps: (\d+) loss: (\d+\.\d{4}) iter time \(s\): \d+\.\d{3} samples/sec: \d+\.\d{3}"
    assert len(progress) == 2
    for line, step in zip(progress, (2, 4)):
        match = re.fullmatch(pattern, line)
        assert match and int(match[1]) == step, line
        assert float(match[2]) == pytest.approx(outputs[0]["losses"][step - 1], abs=1e-4)
    # DeepSpeed's order: the micro and global lines, the progress line, then the transfers
    first = lines.index(progress[0])
    assert lines.index(timed[1]) < first < lines.index(timed[2])
    assert "time (ms)" not in outputs[1]["stdout"] and "steps:" not in outputs[1]["stdout"]


def test_pipeline_progress_line_without_breakdown_or_throughput() -> None:
    outputs = run_on_ranks(_body, 2, breakdown=False, throughput=False, timeout=120)
    assert all(out["timers"] == {} for out in outputs)
    lines = outputs[0]["stdout"].splitlines()
    assert not [ln for ln in lines if "time (ms)" in ln]
    progress = [ln for ln in lines if ln.startswith("steps: ")]
    assert len(progress) == 2
    assert all(re.fullmatch(r"steps: \d+ loss: \d+\.\d{4} iter time \(s\): \d+\.\d{3}", ln)
               for ln in progress), progress  # fmt: skip
