"""Checkpoints: a restart from ``state_dict()`` continues bit for bit (counters, moments, 0/1
Adam's synchronised parameters and this rank's compression errors all come back); errors saved
by another rank restart at zero with a warning; the current ``exp_avg_mask`` wins, as in
DeepSpeed; torch's per-parameter layout holds views of the flat state."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch

from ds_testing import run_on_ranks

_HYPER: dict[str, dict[str, Any]] = {
    "OneBitAdam": {"lr": 1e-2, "freeze_step": 4},
    "ZeroOneAdam": {
        "lr": 1e-2,
        "var_freeze_step": 6,
        "var_update_scaler": 2,
        "local_step_scaler": 2,
        "local_step_clipper": 4,
    },
    "OneBitLamb": {"lr": 1e-2, "freeze_step": 4, "weight_decay": 0.01},
}
_SAVE_AT, _STEPS = 11, 16  # 0/1 Adam saves mid-way through a local-step interval of 4


def _setup(name: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    import ds_optim

    groups = [{"params": params[:1]}, {"params": params[1:], "lr": 5e-3}]
    return getattr(ds_optim, name)(groups, **_HYPER[name])


def _fresh_params() -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((9, 4), (13,), (1,))]


def _step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], step: int) -> None:
    import ds_comm

    g = torch.Generator().manual_seed(100 * step + ds_comm.get_rank())
    for p in params:
        p.grad = p.detach() - 1 + torch.randn(p.shape, generator=g)
    optimizer.step()


def _round_trip(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _restart_body(rank: int, world_size: int, *, name: str) -> None:
    params = _fresh_params()
    optimizer = _setup(name, params)
    for step in range(_SAVE_AT):
        _step(optimizer, params, step)
    saved_params = [p.detach().clone() for p in params]
    saved = _round_trip(optimizer.state_dict())
    for step in range(_SAVE_AT, _STEPS):
        _step(optimizer, params, step)

    restarted = [torch.nn.Parameter(p.clone()) for p in saved_params]
    fresh = _setup(name, restarted)
    fresh.load_state_dict(saved)
    for step in range(_SAVE_AT, _STEPS):
        _step(fresh, restarted, step)
    for a, b in zip(params, restarted):
        assert torch.equal(a, b), f"{name}: the restart diverged"
    for ours, theirs in zip(
        optimizer.state_dict()["onebit"]["groups"], fresh.state_dict()["onebit"]["groups"]
    ):
        assert ours["counters"] == theirs["counters"]
        assert (ours["errors"] is None) == (theirs["errors"] is None) == (world_size == 1)
        for kind in ("worker", "server") if ours["errors"] else ():
            assert torch.equal(ours["errors"][kind], theirs["errors"][kind])


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("name", sorted(_HYPER))
def test_restart_continues_bit_for_bit(name: str, world_size: int) -> None:
    run_on_ranks(_restart_body, world_size, name=name)


def _foreign_errors_body(rank: int, world_size: int) -> None:
    params = _fresh_params()
    optimizer = _setup("OneBitAdam", params)
    for step in range(6):  # two compressed steps: the errors are non-zero
        _step(optimizer, params, step)
    saved = copy.deepcopy(optimizer.state_dict())
    saved["onebit"]["rank"] = (rank + 1) % world_size  # as if saved by the next rank
    assert saved["onebit"]["groups"][0]["errors"]["worker"].abs().sum() > 0

    restarted = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = _setup("OneBitAdam", restarted)
    with pytest.warns(UserWarning, match="restart at zero"):
        fresh.load_state_dict(saved)
    for step in range(6, 9):  # still trains, and the ranks stay identical
        _step(fresh, restarted, step)
    import ds_comm

    flat = torch.cat([p.detach().reshape(-1) for p in restarted])
    gathered = torch.empty(world_size * flat.numel())
    ds_comm.all_gather_into_tensor(gathered, flat)
    assert all(torch.equal(row, flat) for row in gathered.view(world_size, -1))


def test_errors_of_another_rank_restart_at_zero() -> None:
    run_on_ranks(_foreign_errors_body, 2)


def test_state_is_torch_layout_of_views() -> None:
    params = _fresh_params()
    optimizer = _setup("OneBitLamb", params)
    for step in range(2):
        for p in params:
            p.grad = torch.ones_like(p) * (step + 1)
        optimizer.step()
    state = optimizer.state_dict()
    assert sorted(state["state"]) == [0, 1, 2]
    entry = state["state"][0]
    assert set(entry) == {
        "exp_avg",
        "exp_avg_sq",
        "exp_avg_sq_fresh",
        "lamb_coeff_freeze",
        "last_factor",
        "scaling_coeff",
    }
    assert entry["exp_avg"].shape == params[0].shape and entry["last_factor"].dim() == 0
    # Views of the optimizer's flat buffers: the live state, as torch's own optimizers return it.
    assert entry["exp_avg"].data_ptr() == optimizer.state[params[0]]["exp_avg"].data_ptr()
    assert state["onebit"] == {
        "world_size": 1,
        "rank": 0,
        "groups": [
            {"counters": {"step": 2, "scaled": 0}, "errors": None},
            {"counters": {"step": 2, "scaled": 0}, "errors": None},
        ],
    }


def test_load_keeps_the_current_exp_avg_mask() -> None:
    import ds_optim

    params = [torch.nn.Parameter(torch.ones(8))]
    old_mask, new_mask = torch.ones(8), torch.tensor([1.0, 0] * 4)
    optimizer = ds_optim.OneBitAdam([{"params": params, "exp_avg_mask": old_mask}], freeze_step=1)
    params[0].grad = torch.ones(8)
    optimizer.step()
    saved = optimizer.state_dict()

    fresh = ds_optim.OneBitAdam([{"params": params, "exp_avg_mask": new_mask}], freeze_step=1)
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["exp_avg_mask"] is new_mask
    unmasked = ds_optim.OneBitAdam(params, freeze_step=1)
    unmasked.load_state_dict(saved)
    assert "exp_avg_mask" not in unmasked.param_groups[0]


def test_load_rejects_other_optimizers_state() -> None:
    import ds_optim

    params = _fresh_params()
    adam = torch.optim.Adam(params)
    for p in params:
        p.grad = torch.ones_like(p)
    adam.step()
    with pytest.raises(ValueError, match="not saved by OneBitAdam"):
        ds_optim.OneBitAdam(params).load_state_dict(adam.state_dict())
    foreign = adam.state_dict()
    foreign["onebit"] = {"world_size": 1, "rank": 0, "groups": [{"counters": {}, "errors": None}]}
    with pytest.raises(ValueError, match=r"'step'.*another optimizer"):
        ds_optim.OneBitAdam(params).load_state_dict(foreign)


def test_load_before_any_step_leaves_the_state_empty() -> None:
    import ds_optim

    params = _fresh_params()
    saved = ds_optim.ZeroOneAdam(params).state_dict()
    fresh = ds_optim.ZeroOneAdam(params)
    fresh.load_state_dict(saved)
    assert not fresh.state and saved["onebit"]["groups"] == [None]
