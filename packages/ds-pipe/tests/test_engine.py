"""PipelineEngine numerics against the same layers run sequentially in one process.

Each body trains a pipeline for a few batches on gloo ranks and, in the same rank, the
``_pipe_models.Reference`` of the same layers on the same micro-batches (data-parallel replicas'
micro-batches included, averaged as the data-parallel reduction does); losses and every
parameter must agree to 1e-5 relative (fp32).

Each parity test runs twice: with gloo's per-channel tags, and with ``DS_PIPE_TAGLESS=1``, where
every message uses tag 0 and the ranks' posting order alone pairs receives with sends (as on
NCCL, see [Note: one ordered stream per pair of ranks] in ``_p2p.py``); both must give the same
losses, bit for bit. The tag-free runs also turn ds-comm's device guard on, so every tensor the
pipeline hands to a collective or a transfer is checked against the group's device.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_comm import PipeDataParallelTopology
from ds_pipe import PipelineEngine, PipelineModule
from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
import _pipe_models as pm

ROWS = 3  # rows per micro-batch
TAGLESS = {"DS_PIPE_TAGLESS": "1"}


@contextlib.contextmanager
def _mode_checks(engine: Any) -> Any:
    """Check the engine runs in the mode the environment asks for; with ``DS_PIPE_TAGLESS=1``
    also turn ds-comm's device guard on for the body."""
    import ds_comm

    tagless = os.environ.get("DS_PIPE_TAGLESS") == "1"
    assert engine.channels.tagless == tagless
    previous = ds_comm.device_guard(True if tagless else None)
    try:
        yield
    finally:
        ds_comm.device_guard(previous)


def _model(kind: str) -> tuple[list[Any], Any, Any]:
    if kind == "mlp":
        return pm.mlp_layers(), pm.mse_loss, pm.mlp_batch
    return pm.transformer_layers(num_blocks=2), pm.lm_loss, pm.lm_batch


def _data(make: Any, step: int, m: int, replica: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Micro-batches of one batch; two fixed batches alternate, so the loss goes down."""
    return [make(ROWS, seed=1000 * (step % 2) + 10 * mb + replica) for mb in range(m)]


def _ref_key(name: str) -> str:
    if name.startswith("tied_modules."):
        return "tied." + name[len("tied_modules.") :]
    return "layers." + name


def _build(rank: int, stages: int, dp: int, kind: str, virtual: int) -> tuple[Any, Any, Any]:
    torch.manual_seed(rank)  # the pipeline must not depend on the ranks' global RNG
    layers, loss_fn, make = _model(kind)
    module = PipelineModule(
        layers,
        topology=PipeDataParallelTopology(num_pp=stages, num_dp=dp),
        loss_fn=loss_fn,
        seed_layers=True,
        base_seed=pm.BASE_SEED,
        partition_method="uniform",
        num_virtual_stages=virtual,
    )
    return module, pm.build_reference(layers), (loss_fn, make)


def _train_body(
    rank: int,
    world_size: int,
    *,
    stages: int,
    schedule: str = "1f1b",
    kind: str = "mlp",
    virtual: int = 1,
    m: int = 4,
    steps: int = 10,
    clip: float = 0.0,
    device: str | None = None,
) -> list[float]:
    dp = world_size // stages
    module, ref, (loss_fn, make) = _build(rank, stages, dp, kind, virtual)
    if device is not None:  # the GPU tier: the stage and the reference on the GPU
        module.to(device)
        ref.to(device)
    opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
    engine = PipelineEngine(module, opt, micro_batches=m, schedule=schedule, gradient_clipping=clip)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    replica = module.grid.axis_rank("data")
    dev = next(ref.parameters()).device
    losses = []
    for step in range(steps):
        data = [_data(make, step, m, r) for r in range(dp)]
        with _mode_checks(engine):
            loss = engine.train_batch(iter(data[replica]))
        assert loss.device == engine.device
        ref_opt.zero_grad()
        total = 0.0
        for batch in data:
            for x, y in batch:
                ref_loss = loss_fn(ref(x.to(dev)), y.to(dev))
                (ref_loss / (m * dp)).backward()
                total += float(ref_loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip if clip else math.inf)
        ref_opt.step()
        assert loss.shape == () and math.isclose(float(loss), total / (m * dp), rel_tol=1e-5)
        # always computed: a non-finite norm skips the step (one non-finite policy)
        assert math.isclose(engine.get_global_grad_norm(), float(norm), rel_tol=1e-5)
        losses.append(float(loss))
    ref_state = ref.state_dict()
    names = list(module.state_dict())
    assert names, "every stage of these models holds weights"
    for name, value in module.state_dict().items():
        torch.testing.assert_close(value, ref_state[_ref_key(name)], rtol=1e-5, atol=1e-6)
    assert engine.global_steps == steps
    return losses


@pytest.mark.parametrize(
    ("world_size", "stages", "schedule", "kind", "virtual"),
    [
        (1, 1, "1f1b", "mlp", 1),
        (2, 2, "1f1b", "mlp", 1),
        (2, 2, "gpipe", "tied", 1),
        (2, 2, "interleaved", "mlp", 2),
        (4, 4, "1f1b", "tied", 1),
        (4, 4, "gpipe", "mlp", 1),
        (4, 4, "interleaved", "mlp", 2),
        (4, 2, "1f1b", "tied", 1),
    ],
    ids=[
        "1stage",
        "2stages-1f1b",
        "2stages-gpipe-tied",
        "2stages-interleaved",
        "4stages-tied",
        "4stages-gpipe",
        "4stages-interleaved",
        "2x2dp-tied",
    ],
)
def test_train_matches_sequential(
    world_size: int, stages: int, schedule: str, kind: str, virtual: int
) -> None:
    kwargs = {"stages": stages, "schedule": schedule, "kind": kind, "virtual": virtual}
    results = run_on_ranks(_train_body, world_size, **kwargs)
    assert all(r == results[0] for r in results), "every stage returns the same losses"
    assert results[0][-1] < results[0][0]
    # the same run with every tag equal: the posting order alone pairs the messages
    assert run_on_ranks(_train_body, world_size, env=TAGLESS, **kwargs) == results


def test_global_norm_clipping_covers_every_stage_and_replica() -> None:
    # a small clip threshold: every step clips, with the norm of the whole model
    run_on_ranks(_train_body, 4, stages=2, kind="mlp", clip=0.05, steps=4)


def _eval_body(rank: int, world_size: int, *, stages: int, kind: str) -> float:
    module, ref, (loss_fn, make) = _build(rank, stages, 1, kind, 1)
    engine = PipelineEngine(module, None, micro_batches=3)
    data = _data(make, 7, 3, 0)
    with _mode_checks(engine):
        loss, logits = engine.eval_batch(iter(data), return_logits=True)
    with torch.no_grad():
        outs = [ref(x) for x, _ in data]
        ref_loss = torch.stack([loss_fn(o, y) for o, (_, y) in zip(outs, data)]).mean()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    if engine.is_last_stage():
        torch.testing.assert_close(logits, torch.cat(outs), rtol=1e-5, atol=1e-6)
    else:
        assert logits is None
    with _mode_checks(engine):
        per_mb = engine.eval_batch(iter(data), reduce_output=None)
    if engine.is_last_stage():
        assert len(per_mb) == 3
        torch.testing.assert_close(torch.stack(per_mb).mean(), ref_loss, rtol=1e-5, atol=1e-6)
    assert module.training, "eval_batch restores the training mode"
    return float(loss)


@pytest.mark.parametrize(("world_size", "kind"), [(2, "tied"), (4, "mlp")])
def test_eval_batch_equals_sequential_forward(world_size: int, kind: str) -> None:
    losses = run_on_ranks(_eval_body, world_size, stages=world_size, kind=kind)
    assert run_on_ranks(_eval_body, world_size, stages=world_size, kind=kind, env=TAGLESS) == losses


def _overflow_body(rank: int, world_size: int) -> tuple[int, float]:
    from ds_optim import DynamicLossScaler

    module, ref, (loss_fn, make) = _build(rank, world_size, 1, "mlp", 1)
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    scaler = DynamicLossScaler(initial_scale_power=4, hysteresis=1)
    engine = PipelineEngine(module, opt, micro_batches=2, loss_scaler=scaler)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    poison = {"on": False}
    if engine.is_first_stage():  # an inf gradient on stage 0 only, in step 2
        first = next(module.parameters())
        first.register_hook(lambda g: g * math.inf if poison["on"] else g)
    for step in range(5):
        poison["on"] = step == 2
        data = _data(make, step, 2, 0)
        engine.train_batch(iter(data))
        assert engine.last_step.skipped == (step == 2)
        ref_opt.zero_grad()
        for x, y in data:
            (loss_fn(ref(x), y) / 2).backward()
        if step != 2:
            ref_opt.step()
    for name, value in module.state_dict().items():
        torch.testing.assert_close(value, ref.state_dict()[_ref_key(name)], rtol=1e-5, atol=1e-6)
    return engine.skipped_steps, scaler.loss_scale


def test_fp16_overflow_skip_agrees_across_stages() -> None:
    # the overflow happens on stage 0; the last stage must skip the same step
    assert run_on_ranks(_overflow_body, 2) == [(1, 8.0), (1, 8.0)]


class Boom(torch.nn.Module):
    """Raises in forward on the third call: a stage crashing mid-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.linear = torch.nn.Linear(pm.MLP_DIM, pm.MLP_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("boom in stage")
        return self.linear(x)


def _crash_body(rank: int, world_size: int, *, crash_stage: int) -> tuple[str, float]:
    from ds_pipe import LayerSpec

    layers = pm.mlp_layers(num_blocks=5)
    layers.insert(2 * crash_stage + 1, LayerSpec(Boom))
    module = PipelineModule(
        layers, num_stages=world_size, loss_fn=pm.mse_loss, partition_method="uniform"
    )
    engine = PipelineEngine(module, torch.optim.SGD(module.parameters(), lr=0.1), micro_batches=4)
    start = time.monotonic()
    try:
        for step in range(3):
            engine.train_batch(iter(_data(pm.mlp_batch, step, 4, 0)))
    except Exception as exc:  # every stage must get here, quickly
        return f"{type(exc).__name__}: {exc}", time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.parametrize(
    "tagless", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["tags", "tagless"]
)
@pytest.mark.parametrize("crash_stage", [2, pytest.param(0, marks=pytest.mark.slow)])
def test_crash_in_one_stage_fails_every_stage_quickly(crash_stage: int, tagless: bool) -> None:
    env = TAGLESS if tagless else None
    results = run_on_ranks(_crash_body, 4, crash_stage=crash_stage, fresh=True, timeout=60, env=env)
    for rank, (message, elapsed) in enumerate(results):
        assert message != "no error", f"rank {rank} finished although stage {crash_stage} crashed"
        assert elapsed < 10.0, f"rank {rank} took {elapsed:.1f} s to fail"
    for rank, (message, _) in enumerate(results):
        if rank == crash_stage:
            assert message == "RuntimeError: boom in stage"
        else:
            assert message.startswith("PipelineAbortedError: pipeline stage"), message
            assert "another rank of the pipeline failed" in message


def to_dict(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """A layer whose output cannot cross a stage boundary."""
    return {"hidden": x}


def _non_tensor_body(rank: int, world_size: int) -> str:
    layers = pm.mlp_layers(num_blocks=2)
    layers.insert(2, to_dict)  # the last layer of stage 0 under a uniform partition
    module = PipelineModule(layers, num_stages=2, loss_fn=pm.mse_loss, partition_method="uniform")
    engine = PipelineEngine(module, torch.optim.SGD(module.parameters(), lr=0.1), micro_batches=2)
    try:
        engine.train_batch(iter(_data(pm.mlp_batch, 0, 2, 0)))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.slow
def test_non_tensor_stage_output_is_an_error_naming_stage_and_layer() -> None:
    first, second = run_on_ranks(_non_tensor_body, 2, fresh=True, timeout=60)
    assert first.startswith("TypeError: pipeline stage 0, micro-batch 0, output of layer 2")
    assert "is a dict" in first
    assert second.startswith("PipelineAbortedError")


# --- the GPU tier ------------------------------------------------------------------------------


@pytest.mark.gpu(1)
@pytest.mark.parametrize(("schedule", "virtual"), [("1f1b", 1), ("interleaved", 2)])
def test_two_stages_over_gloo_with_cuda_tensors(schedule: str, virtual: int) -> None:
    # One GPU cannot host two NCCL ranks: two gloo ranks share it, their stages and transfers
    # on cuda:0 (gloo stages point-to-point through the host), every tag equal as on NCCL.
    kwargs = {"stages": 2, "schedule": schedule, "virtual": virtual, "steps": 4}
    results = run_on_ranks(_train_body, 2, device="cuda:0", env=TAGLESS, **kwargs)
    assert results[0] == results[1]


@pytest.mark.gpu(1)
def test_one_stage_on_nccl() -> None:
    # the module moves itself to cuda:LOCAL_RANK on an NCCL group; tag-free by the backend
    results = run_on_ranks(
        _train_body, 1, backend="nccl", stages=1, steps=4, device="cuda:0", env=TAGLESS
    )
    assert results[0][-1] < results[0][0]
