"""``deepspeed.utils.timer``: named wall-clock timers (``SynchronizedWallClockTimer``, Megatron's
design) and a samples-per-second meter (``ThroughputTimer``).

Timers read the host clock after synchronizing the accelerator, so a stop includes the device
work queued before it; on CUDA with device timers (``use_host_timers()`` False) they record
accelerator events instead and read them when the elapsed time is asked for.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from torch.autograd import Variable

from ds_comm.accelerator import get_accelerator
from ds_engine.utils.logging import get_dist_msg, logger, print_dist

__all__ = [
    # DeepSpeed's timer names
    "BACKWARD_GLOBAL_TIMER",
    "BACKWARD_INNER_GLOBAL_TIMER",
    "BACKWARD_INNER_MICRO_TIMER",
    "BACKWARD_MICRO_TIMER",
    "BACKWARD_REDUCE_GLOBAL_TIMER",
    "BACKWARD_REDUCE_MICRO_TIMER",
    "FORWARD_GLOBAL_TIMER",
    "FORWARD_MICRO_TIMER",
    "OPTIMIZER_ALLGATHER_TIMER",
    "OPTIMIZER_GRADIENTS_TIMER",
    "OPTIMIZER_STEP_TIMER",
    "OPTIMIZER_TIMERS",
    "STEP_GLOBAL_TIMER",
    "STEP_MICRO_TIMER",
    # timers
    "EngineTimers",
    "NoopTimer",
    "SynchronizedWallClockTimer",
    "ThroughputTimer",
    "timer_mark",
    "trim_mean",
]

FORWARD_MICRO_TIMER = "fwd_microstep"
FORWARD_GLOBAL_TIMER = "fwd"
BACKWARD_MICRO_TIMER = "bwd_microstep"
BACKWARD_GLOBAL_TIMER = "bwd"
BACKWARD_INNER_MICRO_TIMER = "bwd_inner_microstep"
BACKWARD_INNER_GLOBAL_TIMER = "bwd_inner"
BACKWARD_REDUCE_MICRO_TIMER = "bwd_allreduce_microstep"
BACKWARD_REDUCE_GLOBAL_TIMER = "bwd_allreduce"
STEP_MICRO_TIMER = "step_microstep"
STEP_GLOBAL_TIMER = "step"
# The ZeRO optimizer's phases of a step (DeepSpeed's stage_1_and_2 names).
OPTIMIZER_GRADIENTS_TIMER = "optimizer_gradients"
OPTIMIZER_STEP_TIMER = "optimizer_step"
OPTIMIZER_ALLGATHER_TIMER = "optimizer_allgather"
OPTIMIZER_TIMERS = [OPTIMIZER_ALLGATHER_TIMER, OPTIMIZER_GRADIENTS_TIMER, OPTIMIZER_STEP_TIMER]
_EPSILON = 1e-6
_GIB = 1024**3


def trim_mean(data: Sequence[float], trim_percent: float) -> float:
    """Mean of ``data`` without the lowest and highest ``trim_percent`` of it (0 when empty)."""
    if not 0.0 <= trim_percent <= 1.0:
        raise ValueError(f"trim_percent = {trim_percent}: expected a fraction in [0, 1]")
    ordered = sorted(data)
    if not ordered:
        return 0.0
    k = round(len(ordered) * trim_percent)
    kept = ordered[k : len(ordered) - k] or ordered
    return sum(kept) / len(kept)


def timer_mark(use_host_timer: bool | None = None) -> Any:
    """A point in time two of which make an interval for :meth:`SynchronizedWallClockTimer.Timer.add_interval`:
    the host clock after synchronizing the accelerator, or a recorded accelerator event when the
    accelerator times on the device (``use_host_timers()`` False, e.g. CUDA)."""
    acc = get_accelerator()
    host = acc.use_host_timers() if use_host_timer is None else use_host_timer
    if host:
        acc.synchronize()
        return time.perf_counter()
    event = acc.Event(enable_timing=True)
    event.record()
    return event


class SynchronizedWallClockTimer:
    """A group of named timers: ``timers("fwd").start()`` ... ``.stop()``, then
    :meth:`log` or ``elapsed``.

    Example:
        >>> timers = SynchronizedWallClockTimer()
        >>> timers("fwd").start(); loss = model(batch); timers("fwd").stop()
        >>> timers.log(["fwd"])  # "time (ms) | fwd: 12.34" on rank 0
    """

    class Timer:
        """One named timer accumulating start/stop intervals (milliseconds)."""

        def __init__(self, name: str) -> None:
            self.name_ = name
            self.started_ = False
            self.use_host_timer = get_accelerator().use_host_timers()
            self._start: Any = None
            self._intervals: list[Any] = []  # seconds, or (start, end) events
            self.elapsed_records: list[float] | None = None

        def start(self) -> None:
            """Start timing; starting a started timer is an error."""
            if self.started_:
                raise RuntimeError(f"timer {self.name_!r} has already been started")
            if self.use_host_timer:
                get_accelerator().synchronize()
                self._start = time.perf_counter()
            else:
                self._start = get_accelerator().Event(enable_timing=True)
                self._start.record()
            self.started_ = True

        def stop(self, reset: bool = False, record: bool = False) -> None:
            """Stop timing and keep the interval (``reset``/``record``: DeepSpeed's, unused)."""
            del reset, record
            if not self.started_:
                raise RuntimeError(f"timer {self.name_!r} is not started")
            if self.use_host_timer:
                get_accelerator().synchronize()
                self._intervals.append(time.perf_counter() - self._start)
            else:
                end = get_accelerator().Event(enable_timing=True)
                end.record()
                self._intervals.append((self._start, end))
            self.started_ = False

        def add_interval(self, start: Any, end: Any) -> None:
            """Add the interval between two :func:`timer_mark` readings (an interval whose
            marks were taken elsewhere, e.g. inside an autograd or optimizer hook)."""
            if isinstance(start, float) != isinstance(end, float):
                raise TypeError(f"timer {self.name_!r}: marks of different kinds")
            self._intervals.append(end - start if isinstance(start, float) else (start, end))

        def _records(self) -> list[float]:
            out = []
            for i, item in enumerate(self._intervals):
                if isinstance(item, tuple):  # resolve an event pair once, keep its seconds
                    item[1].synchronize()
                    item = float(item[0].elapsed_time(item[1])) / 1000.0
                    self._intervals[i] = item
                out.append(item * 1000.0)
            self.elapsed_records = out
            return out

        def fold(self) -> None:
            """Replace the intervals by their sum: ``elapsed()`` is unchanged, memory stays
            constant however long the timer runs (``mean()`` then sees one interval)."""
            if len(self._intervals) > 1:
                self._intervals[:] = [sum(self._records()) / 1000.0]

        def reset(self) -> None:
            """Forget every interval and stop."""
            self.started_, self._start = False, None
            self._intervals.clear()
            self.elapsed_records = None

        def elapsed(self, reset: bool = True) -> float:
            """Milliseconds timed so far (a running timer is included and keeps running)."""
            running = self.started_
            if running:
                self.stop()
            total = sum(self._records())
            if reset:
                self.reset()
            if running:
                self.start()
            return total

        def mean(self) -> float:
            """Trimmed mean (10%) of the intervals, in milliseconds."""
            self.elapsed(reset=False)
            return trim_mean(self.elapsed_records or [], 0.1)

    def __init__(self) -> None:
        self.timers: dict[str, SynchronizedWallClockTimer.Timer] = {}

    def get_timers(self) -> dict[str, SynchronizedWallClockTimer.Timer]:
        """Name -> timer."""
        return self.timers

    def __call__(self, name: str) -> SynchronizedWallClockTimer.Timer:
        if name not in self.timers:
            self.timers[name] = self.Timer(name)
        return self.timers[name]

    @staticmethod
    def memory_usage() -> str:
        """The accelerator's allocated / cached memory, formatted for :meth:`log`."""
        acc = get_accelerator()
        return (
            f" | mem_allocated: {acc.memory_allocated() / _GIB:.4f} GB"
            f" | max_mem_allocated: {acc.max_memory_allocated() / _GIB:.4f} GB"
            f" | cache_allocated: {acc.memory_cached() / _GIB:.4f} GB"
            f" | max_cache_allocated: {acc.max_memory_cached() / _GIB:.4f} GB"
        )

    def log(
        self,
        names: Iterable[str],
        normalizer: float = 1.0,
        reset: bool = True,
        memory_breakdown: bool = False,
        ranks: Sequence[int] | None = None,
    ) -> None:
        """Print ``time (ms) | name: value ...`` for the named timers on ``ranks`` (rank 0)."""
        if not normalizer > 0.0:
            raise ValueError(f"normalizer = {normalizer}: expected > 0")
        line = "time (ms)"
        for name in names:
            if name in self.timers:
                line += f" | {name}: {self.timers[name].elapsed(reset=reset) / normalizer:.2f}"
        if memory_breakdown:
            line += self.memory_usage()
        print_dist(line, ranks=list(ranks) if ranks else [0])

    def get_mean(
        self, names: Iterable[str], normalizer: float = 1.0, reset: bool = True
    ) -> dict[str, float]:
        """Name -> trimmed mean interval (ms) / ``normalizer`` (``reset``: DeepSpeed's, unused)."""
        del reset
        if not normalizer > 0.0:
            raise ValueError(f"normalizer = {normalizer}: expected > 0")
        return {n: self.timers[n].mean() / normalizer for n in names if n in self.timers}


class NoopTimer:
    """A :class:`SynchronizedWallClockTimer` stand-in that measures nothing (timers off)."""

    class Timer:
        def start(self) -> None: ...

        def reset(self) -> None: ...

        def stop(self, **kwargs: Any) -> None: ...

        def elapsed(self, **kwargs: Any) -> float:
            return 0.0

        def mean(self) -> float:
            return 0.0

    def __init__(self) -> None:
        self.timer = self.Timer()

    def __call__(self, name: str) -> NoopTimer.Timer:
        return self.timer

    def get_timers(self) -> dict[str, Any]:
        return {}

    def log(self, names: Iterable[str], *args: Any, **kwargs: Any) -> None: ...

    def get_mean(self, names: Iterable[str], *args: Any, **kwargs: Any) -> dict[str, float]:
        return {}


class ThroughputTimer:
    """Samples per second over optimizer steps, after ``start_step`` warm-up steps.

    Args:
        config: anything with ``enabled`` and ``synchronized`` (DeepSpeed's ``timers.throughput``
            section).
        batch_size: samples per optimizer step (the global batch).
        start_step: steps not counted (warm-up).
        steps_per_output: log every this many steps (None: never).
        monitor_memory: also log host memory use (needs ``psutil``).
        logging_fn: where lines go (default: the DeepSpeed logger's ``info``).
    """

    def __init__(
        self,
        config: Any,
        batch_size: int | None,
        start_step: int = 2,
        steps_per_output: int | None = None,
        monitor_memory: bool = False,
        logging_fn: Callable[[str], Any] | None = None,
    ) -> None:
        self.config = config
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step, self.steps_per_output = start_step, steps_per_output
        self.monitor_memory = monitor_memory
        self.logging = logging_fn if logging_fn is not None else logger.info
        if monitor_memory:
            import psutil  # noqa: F401  (fails here, not at the first report)
        self.start_time = self.end_time = 0.0
        self.started = self.initialized = False
        self.epoch_count = self.micro_step_count = self.global_step_count = 0
        self.total_elapsed_time = self.step_elapsed_time = 0.0

    def update_epoch_count(self) -> None:
        """Start a new epoch."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        """Start timing a micro-step (only counted after ``start_step`` steps)."""
        if not self.config.enabled:
            return
        self.initialized = self.started = True
        if self.global_step_count >= self.start_step:
            if self.config.synchronized:
                get_accelerator().synchronize()
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        """Stop timing; ``global_step`` closes an optimizer step (and may log)."""
        if not self.config.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time <= 0:
            return
        if self.config.synchronized:
            get_accelerator().synchronize()
        self.end_time = time.time()
        duration = self.end_time - self.start_time
        self.total_elapsed_time += duration
        self.step_elapsed_time += duration
        if not global_step:
            return
        every = self.steps_per_output
        if report_speed and every and self.global_step_count % every == 0:
            self._report()
        self.step_elapsed_time = 0.0

    def _report(self) -> None:
        acc = get_accelerator()
        self.logging(
            f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/"
            f"global_step={self.global_step_count}, "
            f"RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
            f"CurrSamplesPerSec={self.batch_size / (self.step_elapsed_time + _EPSILON)}, "
            f"MemAllocated={round(acc.memory_allocated() / _GIB, 2)}GB, "
            f"MaxMemAllocated={round(acc.max_memory_allocated() / _GIB, 2)}GB"
        )
        if self.monitor_memory:
            import psutil

            self.logging(
                f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/"
                f"global_step={self.global_step_count}, vm %: "
                f"{psutil.virtual_memory().percent}, swap %: {psutil.swap_memory().percent}"
            )

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the counted steps (-inf before any step)."""
        counted = self.global_step_count - self.start_step
        if self.global_step_count > 0 and counted > 0 and self.total_elapsed_time > 0:
            return self.batch_size / (self.total_elapsed_time / counted)
        return float("-inf")


class EngineTimers:
    """The engine's ``wall_clock_breakdown``: DeepSpeed's timer names, measured around the
    engine's calls (see [Note: the engine's timer breakdown]).

    [Note: the engine's timer breakdown]
    ``forward``, ``backward`` and ``step`` are timed around the engine's calls into the module
    and the gradient step, each as a micro-step timer (``fwd_microstep``) and a global one
    (``fwd``). Backward is split where autograd finishes: a hook on the loss queues an autograd
    callback that runs once the whole graph has been differentiated, and the mark taken there
    ends ``bwd_inner`` and starts ``bwd_allreduce`` (the gradient reductions still in flight
    when autograd returns: the bucket flushes and waits). The optimizer's phases come from step
    pre/post hooks on the wrapped torch optimizer: ``optimizer_gradients`` (flush, global norm,
    unscale and clip) until its first ``step``, ``optimizer_step`` until its last (a sliced
    step calls it several times), ``optimizer_allgather`` (publishing the updated partitions
    into the parameters) after it. Marks are accelerator events where the accelerator times on
    the device, host clock readings after a synchronize otherwise (:func:`timer_mark`).

    Args:
        enabled: ``wall_clock_breakdown``; disabled, every method is nearly free.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.timers: Any = SynchronizedWallClockTimer() if enabled else NoopTimer()
        self.micro_timers = [
            FORWARD_MICRO_TIMER,
            BACKWARD_MICRO_TIMER,
            BACKWARD_INNER_MICRO_TIMER,
            BACKWARD_REDUCE_MICRO_TIMER,
            STEP_MICRO_TIMER,
        ]
        self.global_timers = [
            FORWARD_GLOBAL_TIMER,
            BACKWARD_GLOBAL_TIMER,
            BACKWARD_INNER_GLOBAL_TIMER,
            BACKWARD_REDUCE_GLOBAL_TIMER,
            STEP_GLOBAL_TIMER,
        ]
        self.optimizer_timers = list(OPTIMIZER_TIMERS)  # DeepSpeed's print order
        self.cache: dict[str, float] = {}
        self._micro_steps = 0
        self._global_steps = 0
        self._at_boundary: dict[str, float] = {}  # fwd/bwd/step ms at the last optimizer step
        self._last_step: dict[str, float] = {}  # ... and within it

    def active_timers(self) -> list[str]:
        """Every timer name the engine fills (empty when disabled)."""
        if not self.enabled:
            return []
        return self.micro_timers + self.global_timers + self.optimizer_timers

    def _add(self, names: Iterable[str], start: Any, end: Any) -> None:
        for name in names:
            self.timers(name).add_interval(start, end)

    @contextlib.contextmanager
    def span(self, names: Sequence[str]) -> Iterator[None]:
        """Time the block under each of ``names`` (one pair of marks; the pipeline engine's
        per-instruction timers)."""
        if not self.enabled:
            yield
            return
        start = timer_mark()
        try:
            yield
        finally:
            self._add(names, start, timer_mark())

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Time the module's forward (``fwd_microstep``, ``fwd``)."""
        if not self.enabled:
            yield
            return
        start = timer_mark()
        try:
            yield
        finally:
            self._add((FORWARD_MICRO_TIMER, FORWARD_GLOBAL_TIMER), start, timer_mark())

    @contextlib.contextmanager
    def backward(self, loss: Any) -> Iterator[None]:
        """Time backward: ``bwd``, split into ``bwd_inner`` (autograd) and ``bwd_allreduce``."""
        if not self.enabled:
            yield
            return
        autograd_done: list[Any] = []

        def on_loss_grad(grad: Any) -> None:
            def mark() -> None:
                autograd_done.append(timer_mark())

            Variable._execution_engine.queue_callback(mark)  # pyright: ignore[reportAttributeAccessIssue]  (torch's private engine handle)

        handle = loss.register_hook(on_loss_grad) if getattr(loss, "requires_grad", False) else None
        start = timer_mark()
        try:
            yield
        finally:
            if handle is not None:
                handle.remove()
            end = timer_mark()
            split = autograd_done[0] if autograd_done else end
            self._add((BACKWARD_MICRO_TIMER, BACKWARD_GLOBAL_TIMER), start, end)
            self._add((BACKWARD_INNER_MICRO_TIMER, BACKWARD_INNER_GLOBAL_TIMER), start, split)
            self._add((BACKWARD_REDUCE_MICRO_TIMER, BACKWARD_REDUCE_GLOBAL_TIMER), split, end)

    @contextlib.contextmanager
    def step(self, optimizer: Any) -> Iterator[None]:
        """Time the gradient step (``step``) and, when the wrapped torch ``optimizer`` steps
        inside it, its phases (``optimizer_gradients``, ``optimizer_step``,
        ``optimizer_allgather``)."""
        if not self.enabled:
            yield
            return
        marks: list[Any] = []
        handles = []
        if hasattr(optimizer, "register_step_pre_hook"):
            handles = [
                optimizer.register_step_pre_hook(lambda *_: marks.append(("pre", timer_mark()))),
                optimizer.register_step_post_hook(lambda *_: marks.append(("post", timer_mark()))),
            ]
        start = timer_mark()
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            end = timer_mark()
            self._add((STEP_MICRO_TIMER, STEP_GLOBAL_TIMER), start, end)
            self._micro_steps += 1
            self._add_optimizer_phases(start, marks, end)

    def _add_optimizer_phases(self, start: Any, marks: list[tuple[str, Any]], end: Any) -> None:
        pre = [m for kind, m in marks if kind == "pre"]
        post = [m for kind, m in marks if kind == "post"]
        if not pre or not post:
            return  # off the accumulation boundary (or skipped for overflow): no optimizer step
        self._global_steps += 1
        self._add((OPTIMIZER_GRADIENTS_TIMER,), start, pre[0])
        self._add((OPTIMIZER_STEP_TIMER,), pre[0], post[-1])
        self._add((OPTIMIZER_ALLGATHER_TIMER,), post[-1], end)
        totals = self._global_totals()
        self._last_step = {n: totals[n] - self._at_boundary.get(n, 0.0) for n in totals}
        self._at_boundary = totals

    def _global_totals(self) -> dict[str, float]:
        names = (FORWARD_GLOBAL_TIMER, BACKWARD_GLOBAL_TIMER, STEP_GLOBAL_TIMER)
        return {n: self.timers(n).elapsed(reset=False) for n in names}

    def global_seconds(self) -> dict[str, float]:
        """Seconds in ``fwd``, ``bwd`` and ``step`` of the last optimizer step (all its
        micro-batches; the FLOPS profiler's latencies); empty before the first."""
        return {n: ms / 1000.0 for n, ms in self._last_step.items()}

    def update_cache(self, names: Iterable[str] | None = None) -> None:
        """Refresh :meth:`snapshot_ms` (milliseconds accumulated since the last report) for
        ``names`` (None: :meth:`active_timers`)."""
        timers = self.timers.get_timers()
        wanted = self.active_timers() if names is None else names
        self.cache = {n: timers[n].elapsed(reset=False) for n in wanted if n in timers}
        for name in self.cache:  # bounded memory without a print (steps_per_print = inf)
            timers[name].fold()

    def snapshot_ms(self) -> dict[str, float]:
        """Every timer's milliseconds since the last report, as of the last ``step()``
        (DeepSpeed's ``get_wall_clock_timers()``; empty when disabled)."""
        return dict(self.cache)

    def report(self, optimizer_steps: int) -> list[str]:
        """DeepSpeed's breakdown lines (``[Rank 0] time (ms) | optimizer_allgather: ...``, then
        the micro and the global timers), means per micro-step for the micro timers and per
        optimizer step for the others over the steps since the last report; resets every
        timer."""
        if not self.enabled:
            return []
        timers = self.timers.get_timers()
        micro = max(self._micro_steps, 1)
        steps = max(optimizer_steps, 1)
        lines = []
        for names, per in (
            (self.optimizer_timers, steps),
            (self.micro_timers, micro),
            (self.global_timers, steps),
        ):
            present = [n for n in names if n in timers]
            if present:
                values = (f"{n}: {timers[n].elapsed(reset=True) / per:.2f}" for n in present)
                line = "time (ms) | " + " | ".join(values)
                lines.append(get_dist_msg(line, ranks=[-1]) or line)
        self._micro_steps = self._global_steps = 0
        self._at_boundary = {}
        return lines
