"""Draw an LR range test (loss against lr on a log axis) to PNG, marking the lrs people pick.

matplotlib is optional (``pip install ds-optim[plot]``) and imported on first use; the figure
is drawn with the Agg canvas directly, so no pyplot state or global backend is touched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from ds_optim.api import LRRangeTestMarks

__all__ = ["plot_lr_range_test"]


def _ema(values: Sequence[float], beta: float) -> list[float]:
    """Bias-corrected exponential moving average (``beta`` = 0 keeps the values as they are)."""
    out, avg = [], 0.0
    for i, value in enumerate(values):
        avg = beta * avg + (1.0 - beta) * value
        out.append(avg / (1.0 - beta ** (i + 1)))
    return out


def _smoothed(losses: Sequence[float], beta: float) -> list[float]:
    """The moving average run forward then backward: a one-way average lags the curve and would
    move both marks to higher lrs."""
    return _ema(_ema(losses, beta)[::-1], beta)[::-1]


def _per_distinct_lr(lrs: list[float], losses: list[float]) -> tuple[list[float], list[float]]:
    """Mean loss per run of equal lrs (a staircase range test holds each lr for many steps)."""
    xs: list[float] = []
    ys: list[list[float]] = []
    for lr, loss in zip(lrs, losses):
        if xs and xs[-1] == lr:
            ys[-1].append(loss)
        else:
            xs.append(lr)
            ys.append([loss])
    return xs, [sum(y) / len(y) for y in ys]


def _steepest_index(lrs: list[float], losses: list[float]) -> int:
    """Where d(loss)/d(log lr) is most negative (finite differences, central inside)."""
    x = [math.log(lr) for lr in lrs]
    slopes = []
    for i in range(len(x)):
        lo, hi = max(i - 1, 0), min(i + 1, len(x) - 1)
        slopes.append((losses[hi] - losses[lo]) / (x[hi] - x[lo]))
    return min(range(len(slopes)), key=slopes.__getitem__)


def _checked(
    lrs: Sequence[float], losses: Sequence[float], smooth: float
) -> list[tuple[float, float]]:
    if len(lrs) != len(losses):
        raise ValueError(f"got {len(lrs)} lrs but {len(losses)} losses: record one loss per lr")
    if not 0.0 <= smooth < 1.0:
        raise ValueError(f"smooth = {smooth!r}: expected a moving-average factor in [0, 1)")
    # A range test usually ends by diverging: drop inf/nan losses rather than fail.
    points = [(float(lr), float(loss)) for lr, loss in zip(lrs, losses) if math.isfinite(loss)]
    if any(lr <= 0 for lr, _ in points):
        raise ValueError("every lr must be > 0 to be drawn on a log axis")
    if len({lr for lr, _ in points}) < 2:
        raise ValueError("need finite losses at two or more distinct lrs to draw a range test")
    return points


def plot_lr_range_test(
    lrs: Sequence[float],
    losses: Sequence[float],
    path: str | Path,
    *,
    smooth: float = 0.9,
    title: str = "LR range test",
    figsize: tuple[float, float] = (8.0, 5.0),
    dpi: int = 100,
) -> LRRangeTestMarks:
    """Draw loss against lr (log x-axis) to a PNG and mark the steepest descent and the minimum.

    Args:
        lrs: the lr of each step (``scheduler.get_last_lr()[0]`` of an :class:`LRRangeTest`).
        losses: the loss of each step; inf/nan (divergence at the end) are left out.
        path: the PNG to write.
        smooth: moving-average factor for the loss (0: none), applied forward and backward
            so the smoothed curve does not lag.
        title: the figure title.
        figsize: size in inches; the image is ``figsize * dpi`` pixels.
        dpi: pixels per inch.

    Returns:
        The path and the two marked lrs (on the smoothed curve).

    Raises:
        ImportError: matplotlib is missing (``pip install ds-optim[plot]``).

    Example:
        >>> marks = plot_lr_range_test(lrs, losses, "lr_range_test.png")
        >>> marks.steepest_lr  # a good peak lr, e.g. for OneCycle's cycle_max_lr
    """
    points = _checked(lrs, losses, smooth)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # pyright: ignore[reportMissingImports]  (optional extra)
        from matplotlib.figure import Figure  # pyright: ignore[reportMissingImports]  (optional extra)
    except ImportError as exc:
        raise ImportError(
            "plot_lr_range_test needs matplotlib: pip install ds-optim[plot]"
        ) from exc

    raw_lrs, raw_losses = [p[0] for p in points], [p[1] for p in points]
    xs, ys = _per_distinct_lr(raw_lrs, _smoothed(raw_losses, smooth))
    steep = _steepest_index(xs, ys)
    lowest = min(range(len(ys)), key=ys.__getitem__)

    fig = Figure(figsize=figsize, dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(raw_lrs, raw_losses, color="0.75", linewidth=1, label="loss")
    ax.plot(xs, ys, color="tab:blue", linewidth=2, label=f"smoothed (factor {smooth:g})")
    ax.plot(xs[steep], ys[steep], "o", color="tab:red", label=f"steepest descent: {xs[steep]:.3g}")
    ax.plot(xs[lowest], ys[lowest], "o", color="tab:green", label=f"minimum loss: {xs[lowest]:.3g}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate (log scale)")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    out = Path(path)
    fig.savefig(out, format="png", dpi=dpi)
    return LRRangeTestMarks(path=out, steepest_lr=xs[steep], min_loss_lr=xs[lowest])
