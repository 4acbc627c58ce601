"""Activation checkpointing every ``activation_checkpoint_interval`` layers: saved activation
bytes (measured with ``saved_tensors_hooks``) drop, gradients stay exact, ``checkpointable_layers``
selects ranges, tuples pass through, and a 2-stage pipeline pass still equals the reference."""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
import _pipe_models as pm

from ds_pipe import LayerSpec, PipelineModule, checkpoint_non_reentrant

WIDTH, ROWS, BLOCKS = 64, 32, 8


def _wide_layers() -> list[Any]:
    return [
        LayerSpec(nn.Linear, pm.MLP_IN, WIDTH),
        *(LayerSpec(pm.MLPBlock, WIDTH) for _ in range(BLOCKS)),
        LayerSpec(nn.Linear, WIDTH, pm.MLP_OUT),
    ]


def _saved_activation_bytes(model: nn.Module, fn: Callable[[], torch.Tensor]) -> int:
    """Bytes autograd keeps for backward while ``fn`` runs, parameters excluded (they are
    saved by reference, not copied)."""
    params = {p.data_ptr() for p in model.parameters()}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if t.data_ptr() not in params:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.sum().backward()
    return total


def _build(interval: int, num_stages: int = 1, **kwargs: Any) -> PipelineModule:
    with contextlib.redirect_stdout(io.StringIO()):
        return PipelineModule(
            _wide_layers(),
            num_stages=num_stages,
            seed_layers=True,
            partition_method="uniform",
            activation_checkpoint_interval=interval,
            **kwargs,
        )


def _memory_body(rank: int, world_size: int) -> dict[int, int]:
    x, _ = pm.mlp_batch(ROWS)
    saved, grads = {}, {}
    for interval in (0, 1, 2, 5):
        model = _build(interval)
        saved[interval] = _saved_activation_bytes(model, lambda m=model: m(x))
        grads[interval] = [p.grad.clone() for p in model.parameters()]
    for interval in (1, 2, 5):
        for got, want in zip(grads[interval], grads[0]):
            torch.testing.assert_close(got, want, rtol=0, atol=0)  # recompute is exact
    activation = ROWS * WIDTH * 4
    # without checkpointing each block keeps its linear's input and its tanh's output
    assert saved[0] >= 2 * BLOCKS * activation, saved
    # with it only each checkpointed range's input stays: 10 layers / interval ranges
    assert saved[1] <= 10 * activation + ROWS * pm.MLP_IN * 4
    assert saved[2] <= 5 * activation
    assert saved[5] <= 2 * activation
    assert saved[0] >= 10 * saved[5]
    return saved


def test_checkpointing_cuts_saved_activation_bytes_and_keeps_gradients() -> None:
    (saved,) = run_on_ranks(_memory_body, 1)
    print(f"saved activation bytes by interval: {saved}")


class _Recorder:
    """An activation_checkpoint_func that records which layer classes each call covered."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, function: Callable[..., Any], *args: Any) -> Any:
        self.calls.append([type(a).__name__ for a in args])
        return checkpoint_non_reentrant(function, *args)


def _selection_body(rank: int, world_size: int) -> None:
    x = pm.mlp_batch(4)[0].requires_grad_()
    # mlp_layers: Linear, MLPBlock, scale_half, MLPBlock x5, Linear
    for checkpointable, expected in ((None, 8), (["MLPBlock"], 6), (["Linear"], 2)):
        recorder = _Recorder()
        with contextlib.redirect_stdout(io.StringIO()):
            model = PipelineModule(
                pm.mlp_layers(),
                num_stages=1,
                activation_checkpoint_interval=1,
                activation_checkpoint_func=recorder,
                checkpointable_layers=checkpointable,
            )
        model(x).sum().backward()
        assert len(recorder.calls) == expected, (checkpointable, recorder.calls)
        with torch.no_grad():
            model(x)
        assert len(recorder.calls) == expected  # no checkpointing without grad
    # a range mixing a listed and an unlisted class is not checkpointed
    recorder = _Recorder()
    with contextlib.redirect_stdout(io.StringIO()):
        model = PipelineModule(
            pm.mlp_layers(),
            num_stages=1,
            activation_checkpoint_interval=3,
            activation_checkpoint_func=recorder,
            checkpointable_layers=["MLPBlock"],
        )
    model(x)
    # ranges [Linear, MLPBlock, scale_half], [MLPBlock x3], [MLPBlock x2, Linear]: only the middle
    assert len(recorder.calls) == 1


def test_checkpointable_layers_select_ranges() -> None:
    run_on_ranks(_selection_body, 1)


class Split(nn.Module):
    """Returns a tuple ``(x, scale)``: checkpointed ranges must pass tuples through."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(pm.MLP_IN, pm.MLP_IN)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x), x.abs().mean(dim=1, keepdim=True)


class Merge(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(pm.MLP_IN, pm.MLP_IN)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, scale = inputs
        return self.linear(x) * scale


def _tuple_body(rank: int, world_size: int) -> None:
    layers = [LayerSpec(Split), LayerSpec(Merge), LayerSpec(Split), LayerSpec(Merge)]
    x = pm.mlp_batch(4)[0].requires_grad_()
    results = []
    for interval in (0, 1, 3):
        with contextlib.redirect_stdout(io.StringIO()):
            model = PipelineModule(
                layers, num_stages=1, seed_layers=True, activation_checkpoint_interval=interval
            )
        x.grad = None
        out = model(x)
        out.sum().backward()
        results.append((out.detach(), x.grad.clone()))
    for out, grad in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=0, atol=0)
        torch.testing.assert_close(grad, results[0][1], rtol=0, atol=0)


def test_tuples_pass_through_checkpointed_ranges() -> None:
    run_on_ranks(_tuple_body, 1)


def _pipeline_body(rank: int, world_size: int) -> dict[str, int]:
    x, y = pm.mlp_batch(ROWS)
    reference = pm.build_reference(_wide_layers())
    outs = pm.boundary_outputs(reference, x)
    pm.mse_loss(reference(x), y).backward()
    saved = {}
    for interval in (0, 2):
        model = _build(interval, num_stages=2)

        def step(m: PipelineModule = model) -> torch.Tensor:
            pm.run_micro_batch(m, x, y, pm.mse_loss, outs)
            return torch.zeros((), requires_grad=True)  # backward already ran inside

        saved[f"interval_{interval}"] = _saved_activation_bytes(model, step)
        assert pm.max_param_error(model, reference, grads=True) < 1e-6
    # each stage: 5 layers; 9 activations kept without checkpointing, 3 range inputs with it
    activation = ROWS * WIDTH * 4
    assert saved["interval_0"] >= 8 * activation
    assert saved["interval_2"] <= 3 * activation + ROWS * (pm.MLP_IN + 2 * pm.MLP_OUT) * 4
    return saved


def test_two_stage_pass_with_checkpointing_matches_reference() -> None:
    per_stage = run_on_ranks(_pipeline_body, 2)
    print(f"saved activation bytes per stage: {per_stage}")


@pytest.mark.parametrize("interval", [1, 4])
def test_checkpoint_interval_is_stored(interval: int) -> None:
    assert run_on_ranks(_interval_body, 1, interval) == [interval]


def _interval_body(rank: int, world_size: int, interval: int) -> int:
    return _build(interval).activation_checkpoint_interval
