"""``deepspeed.profiling.flops_profiler.profiler``: per-module parameters, MACs, FLOPs and forward
latency of a model, DeepSpeed's ``FlopsProfiler`` and ``get_model_profile``.

Counting is done at the aten level (see [Note: counting below torch.nn.functional] in
``_counting.py``) instead of by patching ``torch.nn.functional``, so operators DeepSpeed's
profiler does not see (``x * y``, ``x + y``, ``rsqrt``, ``log_softmax`` ...) are counted, and
matrix products give exactly ``torch.utils.flop_counter.FlopCounterMode``'s numbers.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ds_engine.profiling.flops_profiler._counting import OpCounter
from ds_engine.profiling.flops_profiler._report import (
    EngineTimes,
    ProfileView,
    aggregated_profile,
    render_report,
)
from ds_engine.profiling.flops_profiler._units import (
    DEFAULT_PRECISION,
    bytes_to_string,
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)
from ds_engine.utils.logging import logger

__all__ = [
    "DEFAULT_PRECISION",
    "FlopsProfiler",
    "bytes_to_string",
    "duration_to_string",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]


def _param_count(module: nn.Module) -> int:
    """Parameters of ``module`` and its children, each counted once (tied weights too)."""
    return sum(p.numel() for p in module.parameters())


class FlopsProfiler:
    """Measures each module's parameters, forward MACs/FLOPs and forward latency.

    Args:
        model: the module to profile.
        ds_engine: the engine training it (adds world sizes and its fwd/bwd/step timers to the
            summary).
        recompute_fwd_factor: the share of the forward recomputed in backward (activation
            checkpointing): backward FLOPs are estimated as ``(2 + factor) * forward``.

    Example:
        >>> prof = FlopsProfiler(model)
        >>> prof.start_profile()
        >>> loss = model(batch)
        >>> prof.stop_profile()
        >>> prof.get_total_flops(as_string=True), prof.get_total_params()
        >>> prof.print_model_profile(profile_step=1)
        >>> prof.end_profile()
    """

    def __init__(
        self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0
    ) -> None:
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self.flops = self.macs = self.params = 0
        self._counter: OpCounter | None = None
        self._counting = False

    # --- lifecycle ------------------------------------------------------------------------------

    def start_profile(self, ignore_list: Iterable[type] | None = None) -> None:
        """Reset the counts and count every forward from now until :meth:`stop_profile`.

        Args:
            ignore_list: module types not profiled separately (their operators count for
                their parent).
        """
        logger.info("Flops profiler started")
        self.stop_profile()
        self._counter = OpCounter(self.model, ignore=ignore_list)
        self._counter.__enter__()
        # The first operator under a dispatch mode imports torch._dynamo (torch disables it
        # around mode dispatch); do that here, not inside the first profiled module's latency.
        torch.zeros(())
        self._counter.reset()
        self._counter.attach()
        self._counting = True
        self.started = True

    def stop_profile(self) -> None:
        """Stop counting; the counts stay readable until :meth:`end_profile`."""
        if self._counter is not None and self._counting:
            self._counter.__exit__(None, None, None)
            self._counter.detach()
            self._counting = False

    def reset_profile(self) -> None:
        """Zero the counts (counting goes on if it was on)."""
        if self._counter is not None:
            self._counter.reset()

    def end_profile(self) -> None:
        """Stop counting and forget the counts."""
        if not self.started:
            return
        self.stop_profile()
        self._counter = None
        self.started = False
        logger.info("Flops profiler finished")

    # --- readings -------------------------------------------------------------------------------

    def _require(self) -> OpCounter:
        if self._counter is None:
            raise RuntimeError(
                "FlopsProfiler has no profile: call start_profile(), run the forward, then read "
                "it before end_profile()"
            )
        return self._counter

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Floating-point operations of the profiled forward."""
        flops = self._require().flops(self.model)
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Multiply-accumulates of the profiled forward."""
        macs = self._require().macs(self.model)
        return macs_to_string(macs) if as_string else macs

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Seconds of the model's profiled forward."""
        duration = self._require().duration(self.model)
        return duration_to_string(duration) if as_string else duration

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Parameters this rank holds (``numel`` of each; a ZeRO-3 shard counts as held)."""
        params = _param_count(self.model)
        return params_to_string(params) if as_string else params

    def _view(self) -> ProfileView:
        counter = self._require()
        return ProfileView(
            model=self.model,
            flops=counter.flops,
            macs=counter.macs,
            params=_param_count,
            duration=counter.duration,
        )

    def _engine_times(self) -> EngineTimes | None:
        engine = self.ds_engine
        if engine is None:
            return None
        times = engine.timers.global_seconds() if hasattr(engine.timers, "global_seconds") else {}
        dp = engine.dp_world_size if engine.dp_world_size is not None else engine.seq_dp_world_size
        return EngineTimes(
            world_size=engine.world_size,
            dp_world_size=dp,
            mp_world_size=engine.mp_world_size,
            micro_batch=engine.train_micro_batch_size_per_gpu(),
            fwd=times.get("fwd"),
            bwd=times.get("bwd"),
            step=times.get("step"),
        )

    # --- reports --------------------------------------------------------------------------------

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
    ) -> None:
        """Print the profile (DeepSpeed's report) to stdout, or write it to ``output_file``.

        Args:
            profile_step: the step number shown in the header.
            module_depth: deepest level of the aggregated profile (-1: all).
            top_modules: module classes listed per depth in the aggregated profile.
            detailed: also print the model tree with each module's profile.
            output_file: a path to write instead of stdout (folders are created).
        """
        if not self.started:
            return
        view = self._view()
        model = self.model
        self.flops, self.macs, self.params = view.flops(model), view.macs(model), view.params(model)
        text = render_report(
            view,
            profile_step=profile_step,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            engine=self._engine_times(),
            recompute_fwd_factor=self.recompute_fwd_factor,
        )
        if output_file:
            folder = os.path.dirname(os.path.abspath(output_file))
            os.makedirs(folder, exist_ok=True)
            with open(output_file, "w", encoding="utf-8") as f:
                f.write(text)
        else:
            sys.stdout.write(text)
            sys.stdout.flush()

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        """Print only the top modules per depth (part of :meth:`print_model_profile`)."""
        if self._counter is None:
            print("no profile: call this function after start_profile and before end_profile")
            return
        print("\n".join(aggregated_profile(self._view(), module_depth, top_modules)))


def _run(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any], mode: str) -> None:
    if mode == "forward":
        model(*args, **kwargs)
    elif mode == "generate":
        generate = getattr(model, "generate", None)
        if generate is None:
            raise ValueError(f"mode='generate': {type(model).__name__} has no generate() method")
        generate(*args, **kwargs)
    else:
        raise ValueError(f"mode = {mode!r}: expected 'forward' or 'generate'")


def get_model_profile(
    model: nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: Iterable[type] | None = None,
    mode: str = "forward",
) -> tuple[Any, Any, Any]:
    """FLOPs, MACs and parameters of one forward of ``model`` (put in eval mode).

    Args:
        model: the module.
        input_shape: call ``model(x)`` with an uninitialised tensor of this shape (the model's
            dtype and device) instead of ``args``/``kwargs``.
        args, kwargs: the forward's arguments.
        print_profile, detailed, module_depth, top_modules, output_file: the report, as in
            :meth:`FlopsProfiler.print_model_profile`.
        warm_up: forwards run before the profiled one (latency only).
        as_string: return ``("1.2 G", "0.6 GMACs", "3.4 M")`` instead of numbers.
        ignore_modules: module types not profiled separately.
        mode: ``"forward"`` or ``"generate"`` (calls ``model.generate``).

    Returns:
        ``(flops, macs, params)``.

    Example:
        >>> flops, macs, params = get_model_profile(model, input_shape=(8, 3, 224, 224))
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    kwargs = dict(kwargs or {})
    args = list(args)
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError(f"input_shape = {input_shape!r}: expected a non-empty tuple")
        first = next(model.parameters(), None)
        dtype = first.dtype if first is not None else None
        device = first.device if first is not None else None
        args = [torch.empty(input_shape, dtype=dtype, device=device)]
    if not args and not kwargs:
        raise ValueError("get_model_profile: give input_shape, or args and/or kwargs")
    model.eval()
    prof = FlopsProfiler(model)
    for _ in range(warm_up):
        _run(model, args, kwargs, mode)
    prof.start_profile(ignore_list=ignore_modules)
    try:
        _run(model, args, kwargs, mode)
    finally:
        prof.stop_profile()
    counter = prof._require()
    flops, macs, params = counter.flops(model), counter.macs(model), _param_count(model)
    if print_profile:
        prof.print_model_profile(
            profile_step=warm_up,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            output_file=output_file,
        )
    prof.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
