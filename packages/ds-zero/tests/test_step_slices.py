"""The optimizer step over slices of a flat CPU master (see [Note: stepping a flat master in
slices] in ``_step_slices.py``) is bit for bit the whole step, for every optimizer it slices, and
leaves the optimizer's param groups and state dict as a whole step does."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import ds_optim
from ds_testing import run_on_ranks
from ds_zero import _adam_replay, _step_slices
from ds_zero._step_slices import step_in_slices

sys.path.insert(0, str(Path(__file__).parent))
from _ds_zero_testing import adam, global_batches, make_model, micro_batches

SLICE = 1000
SIZES = (4099, 1731, 0)  # one group longer than a slice (not a multiple), one shorter, one empty

OPTIMIZERS = {
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=0.1),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adam-l2": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw-decay": lambda ps: torch.optim.AdamW(ps, lr=3e-3, betas=(0.8, 0.95), weight_decay=0.1),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, weight_decay=0.1),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0),
    "ds-optim-fused-adam": lambda ps: ds_optim.FusedAdam(ps, lr=1e-2, weight_decay=0.1),
    "ds-optim-lion": lambda ps: ds_optim.Lion(ps, lr=1e-2, weight_decay=0.1),
}


def _flat_optimizer(make, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    masters = [torch.randn(n, generator=gen) for n in SIZES]
    optimizer = make([{"params": [m]} if m.numel() else {"params": []} for m in masters])
    return masters, optimizer


def _set_grads(masters, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for m in masters:
        m.grad = torch.randn(m.numel(), generator=gen)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_sliced_step_is_the_whole_step_bit_for_bit(name: str) -> None:
    whole, whole_opt = _flat_optimizer(OPTIMIZERS[name])
    sliced, sliced_opt = _flat_optimizer(OPTIMIZERS[name])
    for step in range(4):
        _set_grads(whole, step)
        _set_grads(sliced, step)
        whole_opt.step()
        took = step_in_slices(sliced_opt, SLICE)
        assert took == (step > 0)  # the first step creates the state, whole
        if not took:
            sliced_opt.step()
        for a, b in zip(whole, sliced):
            assert torch.equal(a, b)
    held = [[id(p) for p in g["params"]] for g in sliced_opt.param_groups]
    assert held == [[id(m)] if m.numel() else [] for m in sliced]
    a, b = whole_opt.state_dict(), sliced_opt.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for index, state in a["state"].items():
        assert state.keys() == b["state"][index].keys()
        for key, value in state.items():
            other = b["state"][index][key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, key


def _sliced_steps(name: str, monkeypatch: pytest.MonkeyPatch) -> tuple[int, list[torch.Tensor]]:
    """Calls of the optimizer's ``step`` over three sliced steps after the first, and the
    masters after them."""
    masters, optimizer = _flat_optimizer(OPTIMIZERS[name])
    _set_grads(masters, 0)
    optimizer.step()
    calls = []
    whole_step = optimizer.step
    monkeypatch.setattr(optimizer, "step", lambda: calls.append(1) or whole_step())
    for step in range(1, 4):
        _set_grads(masters, step)
        assert step_in_slices(optimizer, SLICE)
    return len(calls), masters


@pytest.mark.parametrize("name", ["adam", "adam-l2", "adamw", "adamw-decay"])
def test_torch_adam_is_replayed_without_a_step_call_per_slice(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls, _ = _sliced_steps(name, monkeypatch)
    assert calls == 0
    amsgrad_calls, _ = _sliced_steps("adam-amsgrad", monkeypatch)  # not replayed: per slice
    assert amsgrad_calls == 3 * 5  # the 4099-element group takes 5 slices of 1000


def test_a_replay_that_differs_from_torch_is_never_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe catches a replay that computes otherwise (as another torch version might), and
    the step falls back to calling ``step`` per slice: still bit for bit the whole step."""
    replayed_slice = _adam_replay._adam_slice

    def off_by_an_ulp(param: torch.Tensor, *args: Any) -> None:
        replayed_slice(param, *args)
        param.copy_(torch.nextafter(param, torch.full_like(param, torch.inf)))

    monkeypatch.setattr(_adam_replay, "_adam_slice", off_by_an_ulp)
    monkeypatch.setattr(_adam_replay, "_verdicts", {})
    calls, sliced = _sliced_steps("adamw-decay", monkeypatch)
    assert calls == 3 * 5
    whole, whole_opt = _flat_optimizer(OPTIMIZERS["adamw-decay"])
    for step in range(4):
        _set_grads(whole, step)
        whole_opt.step()
    for a, b in zip(whole, sliced):
        assert torch.equal(a, b)


class _Growing(torch.optim.Optimizer):
    """Elementwise, and adds state after its first step (a scalar and a tensor), as an optimizer
    whose momentum is switched on mid-training would."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["count"] = state.get("count", 0) + 1
                if state["count"] < 3:
                    p.sub_(p.grad, alpha=group["lr"])
                    continue
                trace = state.setdefault("trace", torch.zeros_like(p))
                state.setdefault("since", torch.zeros(())).add_(1)
                trace.mul_(0.5).add_(p.grad)
                p.sub_(trace, alpha=group["lr"])


def test_state_added_by_a_sliced_step_is_kept_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_step_slices, "_SLICEABLE", (*_step_slices._SLICEABLE, _Growing))
    whole, whole_opt = _flat_optimizer(_Growing)
    sliced, sliced_opt = _flat_optimizer(_Growing)
    for step in range(5):
        _set_grads(whole, step)
        _set_grads(sliced, step)
        whole_opt.step()
        if not step_in_slices(sliced_opt, SLICE):
            sliced_opt.step()
        for a, b in zip(whole, sliced):
            assert torch.equal(a, b)
    for a, b in zip(whole, sliced):
        if a.numel():
            mine, theirs = whole_opt.state[a], sliced_opt.state[b]
            assert mine["count"] == theirs["count"] == 5
            assert torch.equal(mine["trace"], theirs["trace"])
            assert torch.equal(mine["since"], theirs["since"])
    assert len(sliced_opt.state) == 2  # no slice left behind


def test_not_sliced_when_it_would_not_be_elementwise_or_would_not_help() -> None:
    class Custom(torch.optim.AdamW):  # a subclass may add a per-tensor rule
        pass

    cases = {
        "fused kernel": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
        "subclass": lambda ps: Custom(ps, lr=1e-2),
        "per-tensor rule": lambda ps: torch.optim.Adafactor(ps, lr=1e-2),
    }
    for name, make in cases.items():
        masters, optimizer = _flat_optimizer(make)
        for step in range(2):
            _set_grads(masters, step)
            assert not step_in_slices(optimizer, SLICE), name
            optimizer.step()
    masters, optimizer = _flat_optimizer(OPTIMIZERS["adamw"])
    _set_grads(masters, 0)
    optimizer.step()
    assert not step_in_slices(optimizer, max(SIZES)), "a master that fits in one slice"
    assert step_in_slices(optimizer, SLICE)
    for register in (optimizer.register_step_pre_hook, optimizer.register_step_post_hook):
        handle = register(lambda *_: None)  # a hook means once per step, not per slice
        assert not step_in_slices(optimizer, SLICE), "step hook"
        handle.remove()
    handle = register_optimizer_step_post_hook(lambda *_: None)
    assert not step_in_slices(optimizer, SLICE), "global step hook"
    handle.remove()
    masters[0].grad = None
    assert not step_in_slices(optimizer, SLICE), "no gradient"


def _train(rank: int, world_size: int, stage: int, numel: int) -> tuple[list[torch.Tensor], int]:
    """The parameters after 4 steps, and how many times the wrapped optimizer stepped (a call of
    its ``step``, or one slice replayed: see [Note: replaying torch's Adam over slices])."""
    from ds_zero import ZeroConfig, ZeroOptimizer

    model = make_model(torch.float32)
    config = ZeroConfig.from_dict({"stage": stage, "reduce_bucket_size": 2000})
    optimizer = adam(list(model.parameters()))
    calls = []
    whole_step = optimizer.step  # counted per call (a step hook would turn slicing off)

    def counted_step() -> None:
        calls.append(1)
        whole_step()

    optimizer.step = counted_step  # type: ignore[method-assign]
    replayed_slice = _adam_replay._adam_slice

    def counted_slice(*args: Any) -> None:
        calls.append(1)
        replayed_slice(*args)

    zero = ZeroOptimizer(model, optimizer, config, gradient_clipping=0.5)
    default = _step_slices.STEP_SLICE_NUMEL
    _step_slices.STEP_SLICE_NUMEL = numel  # workers are reused: restored below
    _adam_replay._adam_slice = counted_slice
    try:
        for batch in global_batches(4, 8):
            for micro in micro_batches(batch, rank, world_size, 1):
                zero.backward(model(micro))
                zero.step()
    finally:
        _step_slices.STEP_SLICE_NUMEL = default
        _adam_replay._adam_slice = replayed_slice
    return [p.detach().clone() for p in model.parameters()], len(calls)


@pytest.mark.parametrize(("stage", "world_size"), [(0, 1), (0, 2), (1, 2), (2, 2)])
def test_zero_trains_the_same_with_sliced_steps(stage: int, world_size: int) -> None:
    sliced = run_on_ranks(_train, world_size, stage, 777)
    whole = run_on_ranks(_train, world_size, stage, 1 << 40)
    for rank in range(world_size):
        (sliced_params, sliced_calls), (whole_params, whole_calls) = sliced[rank], whole[rank]
        assert whole_calls == 4 and sliced_calls > 4 + 3  # the first step is whole
        for a, b in zip(sliced_params, whole_params):
            assert torch.equal(a, b)
