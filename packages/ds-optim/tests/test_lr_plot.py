"""The LR range test plot: a valid PNG of the requested size, and the marked lrs on a curve whose
steepest descent and minimum are known."""

from __future__ import annotations

import math
import random
import struct
import sys
from pathlib import Path

import pytest

from ds_optim import LRRangeTest, plot_lr_range_test


def _curve(n: int = 101) -> tuple[list[float], list[float]]:
    """lr from 1e-5 to 1 (x = log10 lr in steps of 0.05); loss = -tanh(2(x + 3)) + 0.5 (x + 1)^2
    past x = -1. The tanh falls fastest at x = -3 (lr 1e-3); the loss is lowest near x = -1."""
    xs = [-5 + 5 * i / (n - 1) for i in range(n)]
    losses = [-math.tanh(2 * (x + 3)) + (0.5 * (x + 1) ** 2 if x > -1 else 0.0) for x in xs]
    return [10**x for x in xs], losses


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_writes_a_png_of_the_requested_size_and_marks_the_known_lrs(tmp_path: Path) -> None:
    lrs, losses = _curve()
    marks = plot_lr_range_test(lrs, losses, tmp_path / "lrrt.png", smooth=0.0)
    assert marks.path == tmp_path / "lrrt.png"
    assert _png_size(marks.path) == (800, 500)  # figsize (8, 5) at 100 dpi
    assert marks.steepest_lr == pytest.approx(1e-3, rel=1e-9)
    assert 10**-1.1 <= marks.min_loss_lr <= 10**-0.9

    from matplotlib.image import imread

    pixels = imread(marks.path)
    assert pixels.shape[:2] == (500, 800)
    assert pixels[..., :3].std() > 0.05  # something was drawn


def test_default_smoothing_of_a_noisy_curve_does_not_shift_the_marks(tmp_path: Path) -> None:
    lrs, losses = _curve()
    noise = random.Random(0)
    noisy = [loss + noise.gauss(0.0, 0.05) for loss in losses]
    marks = plot_lr_range_test(lrs, noisy, tmp_path / "noisy.png")  # smooth=0.9
    # within 0.1 decade of the true steepest point (a one-way average lags by about 0.5)
    assert 10**-3.1 <= marks.steepest_lr <= 10**-2.9


def test_size_follows_figsize_and_dpi(tmp_path: Path) -> None:
    lrs, losses = _curve()
    marks = plot_lr_range_test(lrs, losses, tmp_path / "small.png", figsize=(4, 3), dpi=50)
    assert _png_size(marks.path) == (200, 150)


def test_a_real_staircase_range_test_with_a_diverged_tail(tmp_path: Path) -> None:
    import torch

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = LRRangeTest(
        opt,
        lr_range_test_min_lr=1e-4,
        lr_range_test_step_size=5,
        lr_range_test_step_rate=40.0,
        lr_range_test_staircase=True,
    )
    lrs, losses = [], []
    for _ in range(60):
        lr = sched.get_last_lr()[0]
        lrs.append(lr)
        # falls until lr ~ 1e-2, then blows up; the last steps diverge to inf and nan
        losses.append(1.0 / (1.0 + 100 * lr) + (lr / 0.02) ** 4 if lr < 0.035 else math.inf)
        sched.step()
    losses[-1] = math.nan
    marks = plot_lr_range_test(lrs, losses, tmp_path / "stairs.png")
    assert _png_size(marks.path) == (800, 500)
    assert min(lrs) <= marks.steepest_lr <= marks.min_loss_lr < 0.035


@pytest.mark.parametrize(
    ("lrs", "losses", "message"),
    [
        ([1e-3, 1e-2], [1.0], "2 lrs but 1 losses"),
        ([0.0, 1e-2], [1.0, 0.5], "> 0"),
        ([1e-3, 1e-3], [1.0, 0.5], "two or more distinct lrs"),
        ([1e-3, 1e-2], [math.nan, math.inf], "two or more distinct lrs"),
    ],
)
def test_bad_inputs(tmp_path: Path, lrs: list, losses: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plot_lr_range_test(lrs, losses, tmp_path / "x.png")
    with pytest.raises(ValueError, match="smooth"):
        plot_lr_range_test([1e-3, 1e-2], [1.0, 0.5], tmp_path / "x.png", smooth=1.0)


def test_missing_matplotlib_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # makes the import fail as if not installed
    with pytest.raises(ImportError, match=r"pip install ds-optim\[plot\]"):
        plot_lr_range_test([1e-3, 1e-2], [1.0, 0.5], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
