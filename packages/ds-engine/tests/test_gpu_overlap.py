"""GPU tier (``pytest -m gpu``; skipped without CUDA): ZeRO's overlap of communication with
compute on a side stream (ds-zero's ``_streams.py``, [Note: side streams for overlap]).

Two ranks share the GPU over gloo. With ``overlap_comm`` the reducer's copies, casts and
accumulations around each collective (and stage 3's gathers) must run on a CUDA stream of their
own, next to the compute stream, and the training must be bit-identical to the same run without
overlap: a missing wait or ``record_stream`` shows as a different loss or weight. The streams are
read from the profiler's trace (each GPU kernel and copy names its stream).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _engine_testing import config, loss_of, make_dataset, make_mlp

pytestmark = pytest.mark.gpu

STEPS = 3


def _train(rank: int, stage: int, overlap: bool, trace: str | None) -> tuple[list[float], object]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    import ds_engine

    zero = {"stage": stage, "overlap_comm": overlap, "reduce_bucket_size": 300}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    engine, *_ = ds_engine.initialize(
        model=make_mlp(0), config=config(zero_optimization=zero, bf16={"enabled": True})
    )
    assert engine.device.type == "cuda"
    data = make_dataset(8 * STEPS)
    losses = []
    for step in range(STEPS):
        batch = [
            t[8 * step + 4 * rank : 8 * step + 4 * rank + 4].to(engine.device) for t in data.tensors
        ]
        profiled = trace is not None and step == STEPS - 1
        with (
            profile(activities=[ProfilerActivity.CUDA])
            if profiled
            else contextlib.nullcontext() as prof
        ):
            loss = loss_of(engine, batch)
            engine.backward(loss)
            engine.step()
            torch.cuda.synchronize()
        if profiled:
            assert trace is not None and prof is not None
            prof.export_chrome_trace(trace)
        losses.append(loss.item())
    if stage == 3:
        with ds_engine.zero.GatheredParameters(list(engine.module.parameters())):
            params = torch.cat(
                [p.detach().float().reshape(-1).cpu() for p in engine.module.parameters()]
            )
    else:
        params = torch.cat(
            [p.detach().float().reshape(-1).cpu() for p in engine.module.parameters()]
        )
    return losses, params


def _streams(trace: str) -> set[int]:
    """The CUDA streams that ran kernels or copies in a chrome trace."""
    events = json.loads(Path(trace).read_text())["traceEvents"]
    return {
        int(e["args"]["stream"])
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "stream" in e.get("args", {})
    }


def _overlap_body(rank: int, world_size: int, *, stage: int, root: str) -> dict:
    import torch

    trace = str(Path(root) / f"trace{rank}.json")
    overlapped, params = _train(rank, stage, True, trace)
    serial, serial_params = _train(rank, stage, False, None)
    return {
        "streams": len(_streams(trace)),
        "same_losses": overlapped == serial,
        "same_params": bool(torch.equal(params, serial_params)),
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_overlap_comm_runs_on_a_side_stream_and_changes_nothing(stage: int, tmp_path: Path) -> None:
    results = run_on_ranks(
        _overlap_body, 2, env={"LOCAL_RANK": "0"}, stage=stage, root=str(tmp_path), timeout=300
    )
    for result in results:
        assert result["streams"] >= 2, result  # the compute stream and the side stream
        assert result["same_losses"] and result["same_params"], result
