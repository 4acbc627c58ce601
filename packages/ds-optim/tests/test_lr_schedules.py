"""LR schedules: values at chosen steps against DeepSpeed's formulas worked by hand, the torch
scheduler protocol, state_dict round trips, and the ``scheduler`` config section."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import ds_optim
from ds_optim import (
    LRRangeTest,
    OneCycle,
    SchedulerConfig,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_lr_scheduler,
)
from ds_optim.api import ConfigError


def _adam(*lrs: float) -> torch.optim.Adam:
    groups = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": lr} for lr in lrs]
    return torch.optim.Adam(groups)


def _lrs_at(scheduler: torch.optim.lr_scheduler.LRScheduler, iterations: list[int]) -> list:
    """The first group's lr after stepping to each iteration in turn (from -1, one by one)."""
    out = []
    for target in iterations:
        while scheduler.last_batch_iteration < target:
            scheduler.step()
        out.append(scheduler.optimizer.param_groups[0]["lr"])
    return out


# --- LRRangeTest: lr = min_lr * (1 + step_rate * interval), interval = (it + 1) / step_size ----


def test_lr_range_test_continuous_by_hand() -> None:
    opt = _adam(1.0)
    sched = LRRangeTest(
        opt, lr_range_test_min_lr=0.01, lr_range_test_step_size=10, lr_range_test_step_rate=2.0
    )
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01)  # it=-1: interval 0
    # it=4: interval 0.5 -> 0.01 * (1 + 2*0.5) = 0.02; it=14: 1.5 -> 0.01 * 4 = 0.04
    assert _lrs_at(sched, [4, 14]) == pytest.approx([0.02, 0.04], rel=1e-12)


def test_lr_range_test_staircase_by_hand() -> None:
    sched = LRRangeTest(
        _adam(1.0),
        lr_range_test_min_lr=0.01,
        lr_range_test_step_size=10,
        lr_range_test_step_rate=2.0,
        lr_range_test_staircase=True,
    )
    # interval floored: it=4 -> 0 (0.01); it=9 -> 1 (0.01*3 = 0.03); it=14 -> 1; it=19 -> 2 (0.05)
    assert _lrs_at(sched, [4, 9, 14, 19]) == pytest.approx([0.01, 0.03, 0.03, 0.05], rel=1e-12)


# --- OneCycle ---------------------------------------------------------------------------------


def test_one_cycle_lr_and_betas_through_cycle_and_decay_by_hand() -> None:
    opt = _adam(1.0)
    sched = OneCycle(
        opt,
        cycle_min_lr=0.1,
        cycle_max_lr=1.0,
        cycle_first_step_size=4,
        cycle_second_step_size=6,
        decay_lr_rate=0.5,
        decay_step_size=2,
        cycle_min_mom=0.8,
        cycle_max_mom=0.9,
        decay_mom_rate=0.01,
    )
    # total 10, step_ratio 0.4; x = (it+1)/10 within the cycle.
    # it=-1: x=0, scale 0 -> lr 0.1, mom 0.9
    # it=1: x=0.2, scale 0.2/0.4 = 0.5 -> lr 0.1 + 0.9*0.5 = 0.55, mom 0.9 - 0.1*0.5 = 0.85
    # it=3: x=0.4, scale 1 -> lr 1.0, mom 0.8
    # it=6: x=0.7, scale (0.7-1)/(0.4-1) = 0.5 -> lr 0.55, mom 0.85
    # it=8: x=0.9, scale (-0.1)/(-0.6) = 1/6 -> lr 0.1 + 0.15 = 0.25, mom 0.9 - 0.1/6
    # it=9: x wraps to 0 -> lr 0.1, mom 0.9
    # it=10: decay interval (10-10+1)/2 = 0.5 -> lr 0.1/(1 + 0.5*0.5) = 0.08, mom 0.9*1.005
    # it=13: interval 2 -> lr 0.1/2 = 0.05, mom 0.9*(1 + 0.01*2) = 0.918
    expected = {
        -1: (0.1, 0.9),
        1: (0.55, 0.85),
        3: (1.0, 0.8),
        6: (0.55, 0.85),
        8: (0.25, 0.9 - 0.1 / 6),
        9: (0.1, 0.9),
        10: (0.08, 0.9045),
        13: (0.05, 0.918),
    }
    for it, (lr, mom) in expected.items():
        if it >= 0:
            _lrs_at(sched, [it])
        group = opt.param_groups[0]
        assert group["lr"] == pytest.approx(lr, rel=1e-12), it
        assert group["betas"] == pytest.approx((mom, 0.999), rel=1e-12), it  # beta2 kept


def test_one_cycle_staircase_by_hand() -> None:
    sched = OneCycle(
        _adam(1.0),
        cycle_min_lr=0.1,
        cycle_max_lr=1.0,
        cycle_first_step_size=4,
        cycle_first_stair_count=2,
    )
    # second half: 4 steps, 2 stairs (defaults to the first's). position p = it + 1:
    # rising stair = floor(p*2/4)/2: p=1 -> 0, p=2,3 -> 0.5, p=4 -> 1
    # falling stair = floor((8-p)*2/4)/2: p=5,6 -> 0.5, p=7 -> 0
    lrs = _lrs_at(sched, list(range(7)))
    assert lrs == pytest.approx([0.1, 0.55, 0.55, 1.0, 0.55, 0.55, 0.1], rel=1e-12)


def test_one_cycle_cycles_sgd_momentum_and_skips_optimizers_without_one() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    sgd = torch.optim.SGD([p], lr=1.0, momentum=0.5)
    sched = OneCycle(sgd, cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=2)
    assert sgd.param_groups[0]["momentum"] == pytest.approx(0.9)  # cycle start: max momentum
    sched.step(1)  # x = 2/4 = 0.5 = step_ratio: the peak
    assert sgd.param_groups[0]["momentum"] == pytest.approx(0.8)
    with pytest.warns(UserWarning, match="cycle_momentum is off"):
        off = OneCycle(torch.optim.Adagrad([p]), cycle_min_lr=0.1, cycle_max_lr=1.0)
    assert not off.cycle_momentum


# --- WarmupLR / WarmupDecayLR: lr = min + (max - min) * gamma -----------------------------------


def test_warmup_lr_log_by_hand() -> None:
    sched = WarmupLR(_adam(1.0), warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10)
    # gamma = log(it+1)/log(10): it=0 -> 0; it=4 -> log10(5) = 0.69897000433601880;
    # it=9 -> 1; afterwards 1
    lrs = _lrs_at(sched, [0, 4, 9, 50])
    assert lrs == pytest.approx([0.0, 0.069897000433601880, 0.1, 0.1], rel=1e-12)


def test_warmup_lr_linear_per_group_lists_by_hand() -> None:
    opt = _adam(1.0, 1.0)
    sched = WarmupLR(
        opt,
        warmup_min_lr=[0.0, 0.1],
        warmup_max_lr=[1.0, 0.2],
        warmup_num_steps=4,
        warmup_type="linear",
    )
    sched.step(1)  # gamma = 1/4: [0 + 1*0.25, 0.1 + 0.1*0.25]
    assert sched.get_last_lr() == pytest.approx([0.25, 0.125], rel=1e-12)
    assert [g["lr"] for g in opt.param_groups] == sched.get_last_lr()


def test_warmup_lr_default_max_is_each_groups_own_lr() -> None:
    opt = _adam(0.5, 0.2)
    sched = WarmupLR(opt, warmup_num_steps=2, warmup_type="linear")
    assert sched.get_last_lr() == [0.0, 0.0]
    sched.step()
    sched.step()  # it=1: gamma 1/2
    assert sched.get_last_lr() == pytest.approx([0.25, 0.1], rel=1e-12)


def test_warmup_num_steps_of_one_behaves_as_two_as_in_deepspeed() -> None:
    sched = WarmupLR(_adam(1.0), warmup_max_lr=1.0, warmup_num_steps=1, warmup_type="linear")
    assert _lrs_at(sched, [0, 1, 2]) == pytest.approx([0.0, 0.5, 1.0])  # N = max(2, 1)


def test_warmup_decay_lr_by_hand() -> None:
    sched = WarmupDecayLR(
        _adam(1.0),
        total_num_steps=20,
        warmup_min_lr=0.0,
        warmup_max_lr=0.1,
        warmup_num_steps=10,
        warmup_type="linear",
    )
    # warmup: it=5 -> 0.05. After: gamma = (20 - it) / (20 - 10):
    # it=10 -> 1 (0.1); it=15 -> 0.5 (0.05); it=20 -> 0; it=25 -> max(0, -0.5) = 0
    lrs = _lrs_at(sched, [5, 10, 15, 20, 25])
    assert lrs == pytest.approx([0.05, 0.1, 0.05, 0.0, 0.0], rel=1e-12, abs=1e-15)


def test_warmup_decay_lr_log_warmup_by_hand() -> None:
    sched = WarmupDecayLR(_adam(1.0), total_num_steps=20, warmup_max_lr=0.1, warmup_num_steps=10)
    # it=3: gamma = log(4)/log(10) = 0.60205999132796240
    assert _lrs_at(sched, [3]) == pytest.approx([0.060205999132796240], rel=1e-12)


# --- WarmupCosineLR: lr = base_lr * ratio ------------------------------------------------------


def test_warmup_cosine_lr_by_hand() -> None:
    opt = _adam(2.0)
    sched = WarmupCosineLR(
        opt,
        total_num_steps=20,
        warmup_min_ratio=0.1,
        warmup_num_steps=10,
        cos_min_ratio=0.01,
        warmup_type="linear",
    )
    assert opt.param_groups[0]["lr"] == pytest.approx(2.0 * 0.1)  # before the first step
    # warmup ratio = 0.1 + 0.9 * it/10: it=5 -> 0.55; it=9 -> 0.91
    # cosine: p = (it - 10 + 1)/10, ratio = 0.01 + 0.99 * (1 + cos(pi p))/2
    #   it=10: p=0.1, cos(0.1 pi) = 0.95105651629515357 -> (1.95105651629515357)/2
    #          = 0.97552825814757679 -> 0.01 + 0.99 * that = 0.97577297556610102
    #   it=14: p=0.5 -> 0.01 + 0.99*0.5 = 0.505
    #   it=19: p=1 -> 0.01; it=30: p clamped to 1 -> 0.01
    ratios = [0.55, 0.91, 0.97577297556610102, 0.505, 0.01, 0.01]
    lrs = _lrs_at(sched, [5, 9, 10, 14, 19, 30])
    assert lrs == pytest.approx([2.0 * r for r in ratios], rel=1e-12)


def test_warmup_cosine_lr_log_warmup_by_hand() -> None:
    sched = WarmupCosineLR(
        _adam(1.0), total_num_steps=100, warmup_min_ratio=0.1, warmup_num_steps=10
    )
    # it=4: gamma = log10(5) = 0.69897000433601880 -> 0.1 + 0.9 * gamma = 0.72907300390241692
    assert _lrs_at(sched, [4]) == pytest.approx([0.72907300390241692], rel=1e-12)


# --- the torch protocol ------------------------------------------------------------------------

_SCHEDULES = {
    "LRRangeTest": lambda opt: LRRangeTest(opt, lr_range_test_step_size=3),
    "OneCycle": lambda opt: OneCycle(
        opt,
        0.01,
        0.1,
        cycle_first_step_size=3,
        decay_step_size=2,
        decay_lr_rate=0.1,
        decay_mom_rate=0.01,
    ),
    "WarmupLR": lambda opt: WarmupLR(opt, warmup_num_steps=5),
    "WarmupDecayLR": lambda opt: WarmupDecayLR(opt, total_num_steps=15, warmup_num_steps=5),
    "WarmupCosineLR": lambda opt: WarmupCosineLR(opt, total_num_steps=15, warmup_num_steps=5),
}


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, sched, steps: int) -> list:
    history = []
    for _ in range(steps):
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        history.append((sched.get_last_lr(), opt.param_groups[0]["betas"]))
    return history


@pytest.mark.parametrize("name", sorted(_SCHEDULES))
def test_state_dict_round_trip_mid_schedule_continues_identically(name: str) -> None:
    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        return model, torch.optim.Adam(model.parameters(), lr=0.05)

    model, opt = fresh()
    sched = _SCHEDULES[name](opt)
    _train(model, opt, sched, 7)
    opt_state, sched_state = opt.state_dict(), sched.state_dict()
    expected = _train(model, opt, sched, 8)

    model2, opt2 = fresh()
    sched2 = _SCHEDULES[name](opt2)
    model2.load_state_dict(model.state_dict())  # weights are irrelevant to the schedule
    opt2.load_state_dict(opt_state)
    sched2.load_state_dict(sched_state)
    assert sched2.last_batch_iteration == 6
    assert _train(model2, opt2, sched2, 8) == expected


def test_loads_a_deepspeed_checkpoints_scheduler_state() -> None:
    sched = WarmupLR(_adam(1.0), warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    sched.load_state_dict({"last_batch_iteration": 3})  # all DeepSpeed saves
    assert sched.get_last_lr() == pytest.approx([0.3])
    sched.step()
    assert sched.get_last_lr() == pytest.approx([0.4])


def test_is_a_torch_lr_scheduler_with_step_to_iteration_and_tensor_lrs() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.1))
    sched = WarmupLR(opt, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
    assert isinstance(sched, torch.optim.lr_scheduler.LRScheduler)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no torch deprecation warning for step(k)
        sched.step(5)
    assert sched.last_epoch == sched.last_batch_iteration == 5
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(0.5)
    assert sched.get_lr() == sched.get_last_lr() == pytest.approx([0.5])


def test_resuming_with_last_batch_iteration_sets_that_iterations_lr() -> None:
    sched = WarmupLR(
        _adam(1.0),
        warmup_max_lr=1.0,
        warmup_num_steps=10,
        warmup_type="linear",
        last_batch_iteration=4,
    )
    assert sched.get_last_lr() == pytest.approx([0.4])
    sched.step()
    assert sched.get_last_lr() == pytest.approx([0.5])


# --- bad values --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "key"),
    [
        (lambda opt: WarmupLR(opt, warmup_num_steps=0), "WarmupLR.warmup_num_steps"),
        (lambda opt: WarmupLR(opt, warmup_type="cosine"), "WarmupLR.warmup_type"),
        (lambda opt: WarmupLR(opt, warmup_min_lr=[0.1, 0.2]), "WarmupLR.warmup_min_lr"),
        (lambda opt: WarmupDecayLR(opt, total_num_steps=0), "WarmupDecayLR.total_num_steps"),
        (lambda opt: WarmupCosineLR(opt, 10, cos_min_ratio=-1), "WarmupCosineLR.cos_min_ratio"),
        (lambda opt: LRRangeTest(opt, lr_range_test_step_size=0), "lr_range_test_step_size"),
        (lambda opt: OneCycle(opt, 0.1, float("nan")), "OneCycle.cycle_max_lr"),
        (lambda opt: OneCycle(opt, 0.1, 1.0, cycle_first_step_size=0), "cycle_first_step_size"),
    ],
)
def test_bad_values_are_config_errors_naming_the_key(make, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        make(_adam(1.0))


def test_total_below_warmup_warns() -> None:
    with pytest.warns(UserWarning, match="less than warmup_num_steps"):
        WarmupDecayLR(_adam(1.0), total_num_steps=5, warmup_num_steps=10)


# --- the scheduler section ---------------------------------------------------------------------


def test_build_from_section_is_case_insensitive_and_checks_values() -> None:
    opt = _adam(1.0)
    section = {
        "type": "warmupdecaylr",
        "params": {
            "total_num_steps": 20,
            "warmup_max_lr": 0.1,
            "warmup_num_steps": 10,
            "warmup_type": "linear",
        },
    }
    sched = build_lr_scheduler(section, opt)
    assert type(sched) is WarmupDecayLR
    assert _lrs_at(sched, [15]) == pytest.approx([0.05])
    config = SchedulerConfig.from_dict(section)
    assert config.type == "WarmupDecayLR"
    assert type(build_lr_scheduler(config, _adam(1.0))) is WarmupDecayLR


def test_torch_scheduler_names_are_accepted_as_in_deepspeed() -> None:
    opt = _adam(1.0)
    sched = build_lr_scheduler({"type": "steplr", "params": {"step_size": 2, "gamma": 0.5}}, opt)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    assert SchedulerConfig(type="steplr", params={"step_size": 2}).type == "StepLR"


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"type": "WarmupLRR"}, "did you mean 'WarmupLR'"),
        ({"type": "Cosine"}, "not a known schedule"),
        ({"type": 3}, "scheduler.type = 3"),
        ({"params": {}}, "scheduler.type is missing"),
        ({"type": "WarmupLR", "parmas": {}}, "did you mean 'params'"),
        ({"type": "WarmupLR", "params": {"warmup_steps": 1}}, "did you mean 'warmup_num_steps'"),
        ({"type": "WarmupDecayLR", "params": {}}, "total_num_steps is required"),
        ({"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}, "cycle_max_lr is required"),
        ({"type": "WarmupLR", "params": [1]}, "expected a mapping"),
    ],
)
def test_bad_sections_name_the_key_and_the_fix(section: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SchedulerConfig.from_dict(section)


def test_scheduler_config_is_frozen_and_exported() -> None:
    config = SchedulerConfig(type="onecycle", params={"cycle_min_lr": 0.1, "cycle_max_lr": 1.0})
    assert config.type == "OneCycle"
    with pytest.raises(AttributeError):
        config.type = "WarmupLR"  # type: ignore[misc]
    assert {"SchedulerConfig", "build_lr_scheduler", "WarmupCosineLR"} <= set(ds_optim.__all__)
    assert math.isclose(build_lr_scheduler(config, _adam(1.0)).get_last_lr()[0], 0.1)
