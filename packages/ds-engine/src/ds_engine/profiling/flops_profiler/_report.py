"""The profile as text, in DeepSpeed's report shape: a summary, the top modules per depth, and the
model tree with each module's params, MACs, latency and FLOPS (``print_model_profile``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from ds_engine.profiling.flops_profiler._units import (
    DEFAULT_PRECISION,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = ["EngineTimes", "ProfileView", "render_report"]

_RULE = "-" * 78
_LINE = "{:<70}  {:<8}"
_NOTATIONS = (
    "Notations:\n"
    "data parallel size (dp_size), model parallel size(mp_size),\n"
    "number of parameters (params), number of multiply-accumulate operations(MACs),\n"
    "number of floating-point operations (flops), floating-point operations per second (FLOPS),\n"
    "fwd latency (forward propagation latency), bwd latency (backward propagation latency),\n"
    "step (weights update latency), iter latency (sum of fwd, bwd and step latency)\n"
)
_DETAILED_HEAD = (
    "Each module profile is listed after its name in the following order: \n"
    "params, percentage of total params, MACs, percentage of total MACs, fwd latency, "
    "percentage of total fwd latency, fwd FLOPS"
)
_DETAILED_NOTE = (
    "\nNote: 1. A module's own operators (outside its submodules, e.g. a functional "
    "cross_entropy) make up the difference between a parent's MACs (or latency) and the sum of "
    "its submodules'.\n2. Number of floating-point operations is a theoretical estimation, thus "
    "FLOPS computed using that could be larger than the maximum system throughput.\n3. The fwd "
    "latency listed in the top module's profile is directly captured at the module forward "
    "function in PyTorch, thus it's less than the fwd latency shown above which is captured in "
    "the engine.\n"
)


@dataclass(frozen=True)
class EngineTimes:
    """What the engine adds to the summary: sizes and the step's timer readings (seconds;
    ``bwd``/``step`` None without ``wall_clock_breakdown``)."""

    world_size: int
    dp_world_size: int
    mp_world_size: int
    micro_batch: int
    fwd: float | None = None
    bwd: float | None = None
    step: float | None = None


@dataclass(frozen=True)
class ProfileView:
    """Per-module readings the report needs (functions of a module)."""

    model: nn.Module
    flops: Callable[[nn.Module], int]
    macs: Callable[[nn.Module], int]
    params: Callable[[nn.Module], int]
    duration: Callable[[nn.Module], float]


def _pct(part: float, whole: float) -> str:
    return f"{round(100 * part / whole, DEFAULT_PRECISION) if whole else 0:g}"


def _summary(view: ProfileView, step: int, engine: EngineTimes | None, factor: float) -> list[str]:
    model = view.model
    flops, macs, params = view.flops(model), view.macs(model), view.params(model)
    mp = engine.mp_world_size if engine else 1
    out = [f"\n{'-' * 26} DeepSpeed Flops Profiler {'-' * 26}", f"Profile Summary at step {step}:"]
    out.append(_NOTATIONS)
    if engine:
        out.append(_LINE.format("world size: ", engine.world_size))
        out.append(_LINE.format("data parallel size: ", engine.dp_world_size))
        out.append(_LINE.format("model parallel size: ", engine.mp_world_size))
        out.append(_LINE.format("batch size per GPU: ", engine.micro_batch))
    out.append(_LINE.format("params per GPU: ", params_to_string(params)))
    out.append(
        _LINE.format("params of model = params per GPU * mp_size: ", params_to_string(params * mp))
    )
    out.append(_LINE.format("fwd MACs per GPU: ", macs_to_string(macs)))
    out.append(_LINE.format("fwd flops per GPU: ", number_to_string(flops)))
    out.append(
        _LINE.format(
            "fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(flops * mp)
        )
    )
    fwd = engine.fwd if engine and engine.fwd else view.duration(model)
    out.append(_LINE.format("fwd latency: ", duration_to_string(fwd)))
    out.append(
        _LINE.format(
            "fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ",
            flops_to_string(flops / fwd if fwd else 0),
        )
    )
    if engine and engine.bwd is not None and engine.step is not None:
        out += _training_lines(flops, fwd, engine.bwd, engine.step, factor, engine)
    return out


def _training_lines(
    flops: float, fwd: float, bwd: float, step: float, factor: float, engine: EngineTimes
) -> list[str]:
    bwd_factor = 2 + factor
    iter_latency = fwd + bwd + step
    samples = engine.micro_batch * engine.world_size

    def rate(x: float, seconds: float) -> str:
        return flops_to_string(x / seconds if seconds else 0)

    return [
        _LINE.format("bwd latency: ", duration_to_string(bwd)),
        _LINE.format(
            f"bwd FLOPS per GPU = {bwd_factor:g} * fwd flops per GPU / bwd latency: ",
            rate(bwd_factor * flops, bwd),
        ),
        _LINE.format(
            f"fwd+bwd FLOPS per GPU = {bwd_factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
            rate((bwd_factor + 1) * flops, fwd + bwd),
        ),
        _LINE.format("step latency: ", duration_to_string(step)),
        _LINE.format("iter latency: ", duration_to_string(iter_latency)),
        _LINE.format(
            f"FLOPS per GPU = {bwd_factor + 1:g} * fwd flops per GPU / iter latency: ",
            rate((bwd_factor + 1) * flops, iter_latency),
        ),
        _LINE.format(
            "samples/second: ",
            round(samples / iter_latency, DEFAULT_PRECISION) if iter_latency else 0,
        ),
    ]


def aggregated_profile(
    view: ProfileView, module_depth: int = -1, top_modules: int = 1
) -> list[str]:
    """The top ``top_modules`` module classes by params, MACs and latency at each depth."""
    by_depth: dict[int, dict[str, list[float]]] = {}

    def walk(module: nn.Module, depth: int) -> None:
        row = by_depth.setdefault(depth, {}).setdefault(type(module).__name__, [0, 0, 0.0])
        row[0] += view.macs(module)
        row[1] += view.params(module)
        row[2] += view.duration(module)
        for child in module.children():
            walk(child, depth + 1)

    walk(view.model, 0)
    depth = len(by_depth) - 1 if module_depth == -1 else module_depth
    out = [
        f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"
    ]
    for d in range(min(depth, len(by_depth))):
        rows = by_depth[d]

        def top(
            i: int, fmt: Callable[[Any], str], rows: dict[str, list[float]] = rows
        ) -> dict[str, str]:
            ranked = sorted(rows.items(), key=lambda kv: kv[1][i], reverse=True)[:top_modules]
            return {name: fmt(v[i]) for name, v in ranked}

        out.append(f"depth {d}:")
        out.append(f"    params      - {top(1, params_to_string)}")
        out.append(f"    MACs        - {top(0, macs_to_string)}")
        out.append(f"    fwd latency - {top(2, duration_to_string)}")
    return out


def _module_line(view: ProfileView, module: nn.Module, totals: tuple[float, float, float]) -> str:
    params, macs, duration = view.params(module), view.macs(module), view.duration(module)
    flops = view.flops(module)
    items = [
        f"{params_to_string(params)} = {_pct(params, totals[0])}% Params",
        f"{macs_to_string(macs)} = {_pct(macs, totals[1])}% MACs",
        f"{duration_to_string(duration)} = {_pct(duration, totals[2])}% latency",
        flops_to_string(round(flops / duration, DEFAULT_PRECISION) if duration else 0),
    ]
    extra = module.extra_repr()
    if extra:
        items.append(extra)
    return ", ".join(items)


def _tree(view: ProfileView, module: nn.Module, totals: tuple[float, float, float]) -> str:
    """``repr(module)``'s layout with the profile in front of each module's own extra repr."""
    own = _module_line(view, module, totals).split("\n")
    children = [
        f"({name}): " + _tree(view, child, totals).replace("\n", "\n  ")
        for name, child in module.named_children()
    ]
    lines = own + children
    head = type(module).__name__ + "("
    if len(lines) == 1 and not children:
        return head + lines[0] + ")"
    return head + "\n  " + "\n  ".join(lines) + "\n)"


def render_report(
    view: ProfileView,
    *,
    profile_step: int,
    module_depth: int,
    top_modules: int,
    detailed: bool,
    engine: EngineTimes | None = None,
    recompute_fwd_factor: float = 0.0,
) -> str:
    """The whole report, DeepSpeed's sections in DeepSpeed's order."""
    out = _summary(view, profile_step, engine, recompute_fwd_factor)
    out.append("\n" + "-" * 29 + " Aggregated Profile per GPU " + "-" * 29)
    out += aggregated_profile(view, module_depth, top_modules)
    if detailed:
        model = view.model
        totals = (view.params(model), view.macs(model), view.duration(model))
        out.append("\n" + "-" * 30 + " Detailed Profile per GPU " + "-" * 30)
        out.append(_DETAILED_HEAD)
        out.append(_DETAILED_NOTE)
        out.append(_tree(view, model, totals))
    out.append(_RULE)
    return "\n".join(out) + "\n"
