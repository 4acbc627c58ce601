"""What rank 0 tells the user: the numerics contract at start, a progress bar, log lines, timers.

[Note: the numerics contract]
ZeRO and DDP runs differ in ways a user cannot see from the loss curve: which dtype gradients
accumulate and are reduced in, where the fp32 master weights live, whether the loss is scaled,
and in which order gradients are summed. The engine prints these once, as a table, so two runs
can be compared before anyone starts bisecting.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any

from ds_comm.accelerator import get_accelerator
from ds_engine.api import DeepSpeedConfig

__all__ = ["Progress", "Timers", "numerics_table"]

_DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _reduction_order(config: DeepSpeedConfig, self_reducing: bool) -> str:
    if self_reducing:
        return "optimizer's own compressed all-reduce (1-bit, error feedback) in step()"
    stage = config.zero_optimization.stage
    when = "every micro-batch" if stage >= 2 else "at the accumulation boundary"
    op = "all-reduce" if stage == 0 else "reduce-scatter"
    zero = config.zero_optimization
    if stage == 3 and zero.zero_quantized_gradients:
        op = "int8 blockwise all-to-all (ZeRO++ qgZ), summed in fp32,"
    if stage == 3 and zero.mics_shard_size > 1:
        op += f" within MiCS groups of {zero.mics_shard_size}, all-reduced across them,"
    if config.prescale_gradients:
        scaling = "each rank divides by dp size before the sum"
    elif config.gradient_predivide_factor == 1.0:
        scaling = "sums, then divides by dp size"
    else:
        factor = config.gradient_predivide_factor
        scaling = f"divides by {factor:g} before the sum, multiplies by {factor:g}/dp after"
    return f"{op} per bucket {when}, in fixed bucket order; {scaling}"


def numerics_table(config: DeepSpeedConfig, *, self_reducing: bool = False) -> str:
    """The run's numerics contract as a two-column table (see [Note: the numerics contract])."""
    low = _DTYPE_NAMES[config.param_dtype_name]
    zero = config.zero_optimization
    offload = zero.offload_optimizer.enabled
    grads_at = "flat buffer" if zero.stage < 2 else "reduced shard"
    if config.fp16.enabled:
        fp16 = config.fp16
        scaling = (
            f"dynamic (2**{fp16.initial_scale_power}, window {fp16.loss_scale_window})"
            if fp16.dynamic_loss_scale
            else f"static {fp16.loss_scale:g}"
        )
    else:
        scaling = "none"
    master = "float32" + (" (host, offloaded)" if offload else "")
    if low == "float32" and zero.stage == 0:
        master = "float32 (the parameters themselves)"
    wire = _DTYPE_NAMES.get(config.communication_data_type or "", low)
    rows = [
        ("parameters", low),
        ("gradients", f"{low} ({grads_at})"),
        ("gradient accumulation", f"{low}, {config.gradient_accumulation_steps} micro-batches"),
        ("reductions", f"{wire} over {_reduction_ranks(config)}"),
        ("master weights", master),
        ("optimizer state", "float32" + (" (host)" if offload else "")),
        ("loss scaling", scaling),
        (
            "gradient clipping",
            f"{config.gradient_clipping:g}" if config.gradient_clipping else "off",
        ),
        ("ZeRO stage", str(zero.stage)),
        ("reduction order", _reduction_order(config, self_reducing)),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["numerics contract", "-" * (width + 40)]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def _reduction_ranks(config: DeepSpeedConfig) -> str:
    """The ranks gradients are averaged over: data x sequence parallel under Ulysses."""
    sp = config.sequence_parallel_size
    if sp > 1:
        return f"{config.dp_world_size * sp} ranks ({config.dp_world_size} data x {sp} sequence)"
    return f"{config.dp_world_size} data-parallel ranks"


_DEEPSPEED_TIMER = {"forward": "fwd", "backward": "bwd", "step": "step"}


class Timers:
    """Accumulated wall-clock seconds per phase (``forward``, ``backward``, ``step``).

    On CUDA each phase synchronises first, so the times are the phase's own.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        _sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            _sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def snapshot_ms(self) -> dict[str, float]:
        """Milliseconds per phase since the last :meth:`summary`, under DeepSpeed's timer names
        (``fwd``, ``bwd``, ``step``); empty when disabled."""
        return {_DEEPSPEED_TIMER.get(k, k): 1e3 * v for k, v in self.seconds.items()}

    def summary(self, steps: int) -> str:
        """Mean milliseconds per optimizer step of each phase since the last call; resets."""
        steps = max(steps, 1)
        text = " | ".join(f"{k}: {1e3 * v / steps:.1f}ms" for k, v in self.seconds.items())
        self.seconds.clear()
        return text


def _sync() -> None:
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu" and accelerator.is_available():
        accelerator.synchronize()


class Progress:
    """Rank 0's progress: a tqdm bar when stderr is a terminal, a log line every
    ``steps_per_print`` optimizer steps always (non-interactive logs).

    ``throughput`` adds the samples per second since the previous step (DeepSpeed's
    ``timers.throughput.enabled``); ``synchronized`` waits for the accelerator before reading
    the clock, so the figure covers the step's device work (``timers.throughput.synchronized``).
    """

    def __init__(
        self,
        *,
        rank: int,
        steps_per_print: float,
        interactive: bool | None = None,
        throughput: bool = True,
        synchronized: bool = True,
    ) -> None:
        self.active = rank == 0
        self.steps_per_print = steps_per_print
        self.throughput = throughput
        self.synchronized = synchronized
        self._bar: Any = None
        if interactive is None:
            interactive = sys.stderr.isatty()
        if self.active and interactive:
            from tqdm import tqdm

            self._bar = tqdm(desc="train", unit="step", dynamic_ncols=True)
        self._last_time = time.perf_counter()
        self._last_samples = 0

    def update(
        self, *, step: int, samples: int, loss: float | None, lr: float, timers: str
    ) -> None:
        """Record one optimizer step (every rank calls it; only rank 0 shows anything)."""
        if not self.active:
            return
        fields = {"loss": f"{loss:.4f}" if loss is not None else "-", "lr": f"{lr:.3g}"}
        now = self._last_time
        if self.throughput:
            if self.synchronized:
                _sync()
            now = time.perf_counter()
            rate = (samples - self._last_samples) / max(now - self._last_time, 1e-9)
            fields["samples/s"] = f"{rate:.1f}"
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(fields, refresh=False)
        if step % self.steps_per_print == 0:
            line = f"step {step}: " + ", ".join(f"{k}={v}" for k, v in fields.items())
            if timers:
                line += f" | {timers}"
            self.write(line)
        self._last_time, self._last_samples = now, samples

    def write(self, line: str) -> None:
        """Print a line on rank 0 without breaking the bar."""
        if not self.active:
            return
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
