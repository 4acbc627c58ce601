"""Loss scaling: DeepSpeed's dynamic update rule over scripted overflow patterns (expected scales
worked by hand), the static scaler, the ``fp16``/``bf16`` sections, and overflow detection that
agrees across real gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch

from ds_optim import (
    BF16Config,
    DynamicLossScaler,
    FP16Config,
    LossScaleAtMinimumError,
    StaticLossScaler,
    build_loss_scaler,
    has_overflow,
)
from ds_optim.api import ConfigError
from ds_testing import run_on_ranks


def _scales(scaler: DynamicLossScaler, pattern: str) -> list[float]:
    """The scale after each update; ``pattern`` has "O" for an overflowing step, "." for clean."""
    out = []
    for mark in pattern:
        scaler.update_scale(mark == "O")
        out.append(scaler.loss_scale)
    return out


# --- the dynamic update rule -------------------------------------------------------------------

PATTERN = "OO...O.OOOO....."


def test_scripted_overflows_with_hysteresis() -> None:
    scaler = DynamicLossScaler(
        initial_scale_power=4,
        loss_scale_window=2,
        hysteresis=2,
        min_loss_scale=2,
        raise_error_at_min_scale=False,
    )
    # it  event  hysteresis left   scale  why
    #  0  O      2 -> 1            16     hysteresis absorbs it
    #  1  O      1                  8     spent: halve
    #  2  .                         8     clean run since it 1: 2-1-1 = 0
    #  3  .                         8     run 1
    #  4  .      refilled to 2     16     run 2, a multiple of the window: double
    #  5  O      2 -> 1            16     absorbed
    #  6  .      (not refilled)    16     run 0
    #  7  O      1                  8     spent: halve
    #  8  O      1                  4
    #  9  O      1                  2     = min_loss_scale
    # 10  O      1                  2     max(2/2, 2): stays at the floor
    # 11  .                         2     run 0
    # 12  .                         2     run 1
    # 13  .      refilled to 2      4     run 2: double
    # 14  .                         4     run 3
    # 15  .                         8     run 4: double
    expected = [16, 8, 8, 8, 16, 16, 16, 8, 4, 2, 2, 2, 2, 4, 4, 8]
    assert _scales(scaler, PATTERN) == expected


def test_scripted_overflows_with_consecutive_hysteresis() -> None:
    scaler = DynamicLossScaler(
        initial_scale_power=4,
        loss_scale_window=2,
        hysteresis=2,
        consecutive_hysteresis=True,
        min_loss_scale=2,
        raise_error_at_min_scale=False,
    )
    # As above, but every clean step refills the hysteresis: the overflow at it 7 follows a
    # clean step (it 6) and is absorbed again instead of halving the scale.
    # it: 0:O 16 (2->1) | 1:O 8 | 2:. 8 | 3:. 8 | 4:. 16 | 5:O 16 (2->1) | 6:. 16 (refill 2)
    #     7:O 16 (2->1) | 8:O 8 | 9:O 4 | 10:O 2 | 11:. 2 | 12:. 2 | 13:. 4 | 14:. 4 | 15:. 8
    expected = [16, 8, 8, 8, 16, 16, 16, 16, 8, 4, 2, 2, 2, 4, 4, 8]
    assert _scales(scaler, PATTERN) == expected


def test_first_doubling_comes_after_window_plus_one_clean_steps() -> None:
    scaler = DynamicLossScaler(initial_scale_power=0, loss_scale_window=3)
    # run length = it - (-1) - 1 = it: doubles at it 3 and it 6
    assert _scales(scaler, ".......") == [1, 1, 1, 2, 2, 2, 4]


def test_hysteresis_of_one_halves_on_every_overflow() -> None:
    scaler = DynamicLossScaler(initial_scale_power=3, hysteresis=1)
    assert _scales(scaler, "OOO") == [4, 2, 1]


def test_overflow_at_the_minimum_scale_raises_as_in_deepspeed() -> None:
    scaler = DynamicLossScaler(initial_scale_power=2, hysteresis=1, min_loss_scale=2)
    scaler.update_scale(True)  # 4 -> 2
    with pytest.raises(LossScaleAtMinimumError, match="min_loss_scale"):
        scaler.update_scale(True)


def test_state_dict_round_trip_continues_the_same_sequence() -> None:
    def make() -> DynamicLossScaler:
        return DynamicLossScaler(
            initial_scale_power=4,
            loss_scale_window=2,
            hysteresis=2,
            min_loss_scale=2,
            raise_error_at_min_scale=False,
        )

    whole = make()
    expected = _scales(whole, PATTERN)
    first, second = make(), make()
    _scales(first, PATTERN[:6])  # stops with the hysteresis part-spent
    second.load_state_dict(first.state_dict())
    assert _scales(second, PATTERN[6:]) == expected[6:]


# --- scaling the loss, and the static scaler ---------------------------------------------------


def test_backward_scales_gradients_by_the_loss_scale() -> None:
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    scaler = DynamicLossScaler(initial_scale_power=10)
    scaler.backward((w * 3.0).sum())
    assert torch.equal(w.grad, torch.full((2,), 3.0 * 1024))
    assert scaler.scale_loss(torch.tensor(2.0)).item() == 2048.0


def test_static_scaler_never_changes_but_still_detects_overflow() -> None:
    scaler = StaticLossScaler(128.0)
    scaler.update_scale(True)
    assert scaler.loss_scale == scaler.cur_scale == 128.0
    assert scaler.has_overflow([torch.tensor([1.0, math.inf])])
    assert not scaler.dynamic
    with pytest.raises(ValueError, match="loss_scale = 0"):
        StaticLossScaler(0)


# --- overflow detection on one rank ------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_has_overflow_finds_inf_and_nan_in_any_float_dtype(dtype: torch.dtype, bad: float) -> None:
    clean = [torch.randn(5, 3, generator=torch.Generator().manual_seed(0)).to(dtype)]
    assert not has_overflow([*clean, torch.zeros(0, dtype=dtype)])
    dirty = torch.ones(7, dtype=dtype)
    dirty[4] = bad
    assert has_overflow([*clean, dirty])


def test_has_overflow_reads_param_grads_and_skips_params_without_one() -> None:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    a.grad = torch.ones(2)
    assert not has_overflow([a, b])
    b.grad = torch.tensor([0.0, math.nan])
    assert has_overflow([a, b])


def test_fp16_values_past_its_range_are_an_overflow() -> None:
    g = torch.tensor([60000.0], dtype=torch.float16) * 2  # 120000 is inf in fp16
    assert has_overflow([g])


# --- overflow detection across ranks -----------------------------------------------------------


def _one_rank_overflows_body(rank: int, world_size: int, *, bad: float) -> tuple[bool, float]:
    import torch.distributed as dist

    grads = [torch.randn(64, generator=torch.Generator().manual_seed(rank)), torch.ones(3)]
    if rank == world_size - 1:
        grads[0][17] = bad
    local = has_overflow(grads)
    assert local == (rank == world_size - 1)
    scaler = DynamicLossScaler(initial_scale_power=8, hysteresis=1)
    overflow = scaler.has_overflow(grads, group=dist.group.WORLD)
    scaler.update_scale(overflow)
    return overflow, scaler.loss_scale


@pytest.mark.parametrize("bad", [math.inf, math.nan])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_one_ranks_overflow_skips_the_step_on_all_ranks(world_size: int, bad: float) -> None:
    results = run_on_ranks(_one_rank_overflows_body, world_size, bad=bad, timeout=300)
    assert results == [(True, 128.0)] * world_size  # everyone skips, everyone halves


def _subgroup_overflow_body(rank: int, world_size: int) -> bool:
    import ds_comm

    groups = [ds_comm.new_group([0, 1]), ds_comm.new_group([2, 3])]
    grads = [torch.ones(8)]
    if rank == 3:
        grads[0][0] = math.inf
    return has_overflow(grads, group=groups[rank // 2])


def test_overflow_agreement_stays_within_the_group_given() -> None:
    # Ranks 2 and 3 share a group with the overflowing rank 3; ranks 0 and 1 do not.
    assert run_on_ranks(_subgroup_overflow_body, 4, timeout=300) == [False, False, True, True]


# --- the fp16 and bf16 sections ----------------------------------------------------------------


def test_fp16_section_defaults_are_deepspeeds() -> None:
    c = FP16Config.from_dict({})
    assert (c.enabled, c.auto_cast, c.loss_scale, c.initial_scale_power) == (False, False, 0, 16)
    assert (c.loss_scale_window, c.hysteresis, c.consecutive_hysteresis) == (1000, 2, False)
    assert c.min_loss_scale == 1 and c.dynamic_loss_scale


def test_build_loss_scaler_from_sections() -> None:
    dynamic = build_loss_scaler(
        {
            "enabled": True,
            "initial_scale_power": 12,
            "hysteresis": 3,
            "loss_scale_window": 50,
            "min_loss_scale": 0.5,
        }
    )
    assert isinstance(dynamic, DynamicLossScaler)
    assert (dynamic.loss_scale, dynamic.scale_window, dynamic.delayed_shift) == (4096, 50, 3)
    assert dynamic.min_scale == 0.5
    static = build_loss_scaler(FP16Config(enabled=True, loss_scale=256))
    assert type(static) is StaticLossScaler and static.loss_scale == 256
    assert build_loss_scaler(None).loss_scale == 1.0  # fp16 off: no scaling
    assert build_loss_scaler({"enabled": False, "loss_scale": 64}).loss_scale == 1.0


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"loss_scale": -1}, r"fp16.loss_scale = -1: expected a finite number >= 0"),
        ({"loss_scale": True}, "fp16.loss_scale = True"),
        ({"initial_scale_power": 200}, r"fp16.initial_scale_power = 200: .* \[0, 127\]"),
        ({"loss_scale_window": 0}, "fp16.loss_scale_window = 0"),
        ({"hysteresis": 0}, "fp16.hysteresis = 0"),
        ({"min_loss_scale": 0}, "fp16.min_loss_scale = 0: expected a positive"),
        ({"enabled": "yes"}, "fp16.enabled = 'yes': expected true or false"),
        ({"loss_scale_windw": 10}, "did you mean 'loss_scale_window'"),
    ],
)
def test_bad_fp16_sections_name_the_key_and_the_fix(section: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        FP16Config.from_dict(section)


def test_dynamic_scaler_arguments_are_checked_like_the_section() -> None:
    with pytest.raises(ConfigError, match=r"fp16\.hysteresis = 0"):
        DynamicLossScaler(hysteresis=0)


def test_bf16_section() -> None:
    assert BF16Config.from_dict({"enabled": True}).enabled
    assert not BF16Config.from_dict(None).enabled
    with pytest.raises(ConfigError, match="bf16_master_weights_and_grads"):
        BF16Config(bf16_optimizer_states=True)
    with pytest.raises(ConfigError, match="did you mean 'enabled'"):
        BF16Config.from_dict({"enable": True})
