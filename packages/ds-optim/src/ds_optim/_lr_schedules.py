"""DeepSpeed's LR schedules (the ``scheduler`` config section) as torch LR schedulers.

Every schedule is a closed-form function of the batch iteration, with DeepSpeed's formulas,
parameter names and defaults; ``docs/optim-schedules.md`` writes them out and lists where we
differ on purpose.

[Note: batch iterations and the torch scheduler protocol]
DeepSpeed counts ``last_batch_iteration`` from -1: the constructor sets each group's lr to the
schedule's value at iteration -1 (the warmup or cycle start) and leaves the counter at -1; each
``step()`` after an optimizer step advances it by one. torch's ``LRScheduler.__init__`` instead
always takes one step at construction (and patches ``optimizer.step`` to warn about call order),
so a schedule built on it would start one batch late. The schedules here subclass
``LRScheduler`` (so ``isinstance`` checks in trainers hold) but set up the attributes torch's
methods read themselves: ``optimizer``, ``base_lrs`` (from each group's ``initial_lr``, which
is recorded on first use as torch does), ``last_epoch`` (an alias of ``last_batch_iteration``)
and ``_last_lr``. ``step()``, ``get_lr()``, ``get_last_lr()``, ``state_dict()`` and
``load_state_dict()`` are the torch protocol; ``step(k)`` jumps to iteration ``k`` without
torch's deprecation warning, since DeepSpeed's engine passes the iteration that way.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ds_comm.api import check_keys, closest
from ds_optim.api import ConfigError, SchedulerConfig, _check_int, _check_number

__all__ = [
    "SCHEDULES",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_lr_scheduler",
    "check_scheduler_section",
]

WARMUP_TYPES = ("log", "linear")


# --- parameter checks ----------------------------------------------------------------------------


def _per_group(
    owner: str, name: str, value: Any, n_groups: int, *, minimum: float = 0.0
) -> list[float]:
    """One float per param group: a scalar is broadcast, a sequence must have one per group."""
    if isinstance(value, Sequence) and not isinstance(value, str):
        if len(value) != n_groups:
            raise ConfigError(
                f"{owner}.{name} = {list(value)!r}: expected one value per param group "
                f"({n_groups}) or a single number"
            )
        return [_check_number(f"{owner}.{name}", v, minimum=minimum) for v in value]
    return [_check_number(f"{owner}.{name}", value, minimum=minimum)] * n_groups


def _warmup_type(owner: str, value: Any) -> str:
    if value not in WARMUP_TYPES:
        raise ConfigError(f"{owner}.warmup_type = {value!r}: expected one of {list(WARMUP_TYPES)}")
    return value


def _warmup_fraction(batch_iteration: int, num_steps: int, warmup_type: str) -> float:
    """How far warmup has gone at ``batch_iteration`` (< num_steps), from 0 to 1."""
    if warmup_type == "log":
        return math.log(batch_iteration + 1) / math.log(num_steps)
    return batch_iteration / num_steps


def _warn_total_below_warmup(owner: str, total_num_steps: int, warmup_num_steps: int) -> None:
    if total_num_steps < warmup_num_steps:
        warnings.warn(
            f"{owner}: total_num_steps ({total_num_steps}) is less than warmup_num_steps "
            f"({warmup_num_steps}): the lr drops to its floor as soon as warmup ends",
            stacklevel=3,
        )


# --- the protocol ------------------------------------------------------------------------------


class _BatchScheduler(LRScheduler):
    """A closed-form schedule over batch iterations; see [Note: batch iterations and the torch
    scheduler protocol]. Subclasses implement :meth:`lr_at` and call :meth:`_apply` at the end
    of their constructor."""

    def __init__(self, optimizer: Optimizer, last_batch_iteration: int) -> None:
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{type(optimizer).__name__} is not a torch.optim.Optimizer")
        self.optimizer = optimizer
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", float(group["lr"]))
        self.base_lrs = [float(group["initial_lr"]) for group in optimizer.param_groups]
        self.last_batch_iteration = _check_int(
            f"{type(self).__name__}.last_batch_iteration", last_batch_iteration, minimum=-1
        )
        self._step_count = 0
        self._last_lr: list[float] = []

    @property
    def last_epoch(self) -> int:  # torch's name for the counter
        return self.last_batch_iteration

    @last_epoch.setter
    def last_epoch(self, value: int) -> None:
        self.last_batch_iteration = value

    def lr_at(self, batch_iteration: int) -> list[float]:
        """The lr of every param group at ``batch_iteration`` (-1 is before the first step)."""
        raise NotImplementedError

    def get_lr(self) -> list[float]:  # pyright: ignore[reportIncompatibleMethodOverride]
        """The lr of every param group at the current batch iteration."""
        return self.lr_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:  # pyright: ignore[reportIncompatibleMethodOverride]
        """The lrs most recently written into the optimizer's param groups."""
        return self._last_lr

    def step(self, batch_iteration: int | None = None) -> None:  # type: ignore[override]
        """Advance one batch (or jump to ``batch_iteration``) and set the groups' lrs."""
        self._step_count += 1
        if batch_iteration is None:
            batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = batch_iteration
        self._apply()

    def _apply(self) -> None:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = list(lrs)

    def state_dict(self) -> dict[str, Any]:
        """The batch counter (DeepSpeed's whole state), the base lrs and the last lrs."""
        return {
            "last_batch_iteration": self.last_batch_iteration,
            "base_lrs": list(self.base_lrs),
            "_last_lr": list(self._last_lr),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; a DeepSpeed checkpoint's scheduler state also loads.

        The optimizer's lrs are left alone (its own state dict restores them), as in torch.
        """
        self.last_batch_iteration = int(state_dict["last_batch_iteration"])
        if "base_lrs" in state_dict:
            self.base_lrs = [float(lr) for lr in state_dict["base_lrs"]]
        self._last_lr = list(state_dict.get("_last_lr") or self.get_lr())


# --- the schedules -------------------------------------------------------------------------------


class LRRangeTest(_BatchScheduler):
    """Grows the lr from ``lr_range_test_min_lr`` every batch, to find the largest usable lr.

    ``lr = min_lr * (1 + step_rate * interval)``, ``interval = (it + 1) / step_size``, floored
    when ``lr_range_test_staircase``. Record the loss at each ``get_last_lr()`` and draw it with
    :func:`ds_optim.plot_lr_range_test`.

    Args:
        optimizer: any torch optimizer.
        lr_range_test_min_lr: starting lr (one per param group, or one for all).
        lr_range_test_step_size: batches per unit of ``interval``.
        lr_range_test_step_rate: lr growth per interval, as a multiple of ``min_lr``.
        lr_range_test_staircase: grow in steps of ``step_size`` batches instead of every batch.
        last_batch_iteration: the last batch trained (-1 for a fresh start).

    Example:
        >>> sched = LRRangeTest(opt, lr_range_test_min_lr=1e-5, lr_range_test_step_size=100)
        >>> for batch in loader:
        ...     train(batch); opt.step(); sched.step()
    """

    def __init__(
        self,
        optimizer: Optimizer,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        owner, n = "LRRangeTest", len(optimizer.param_groups)
        self.min_lrs = _per_group(owner, "lr_range_test_min_lr", lr_range_test_min_lr, n)
        self.step_size = _check_int(
            f"{owner}.lr_range_test_step_size", lr_range_test_step_size, minimum=1
        )
        self.step_rate = _check_number(f"{owner}.lr_range_test_step_rate", lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        self._apply()

    def lr_at(self, batch_iteration: int) -> list[float]:
        interval = (batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        increase = 1.0 + self.step_rate * interval
        return [min_lr * increase for min_lr in self.min_lrs]


class OneCycle(_BatchScheduler):
    """1Cycle: lr up from ``cycle_min_lr`` to ``cycle_max_lr`` and back, then optional decay.

    Momentum (``betas[0]`` of Adam-style groups, or ``momentum`` of SGD-style ones) moves the
    other way between ``cycle_max_mom`` and ``cycle_min_mom`` when ``cycle_momentum``. The
    formulas, including the staircase and post-cycle decay, are in ``docs/optim-schedules.md``.

    Args:
        optimizer: any torch optimizer.
        cycle_min_lr: lr at the start and end of the cycle (per group or one for all).
        cycle_max_lr: lr at the peak.
        decay_lr_rate: after the cycle, ``lr = cycle_min_lr / (1 + decay_lr_rate * k)``.
        cycle_first_step_size: batches in the rising half.
        cycle_second_step_size: batches in the falling half (default: the rising half's).
        cycle_first_stair_count: stairs in the rising half (0: continuous).
        cycle_second_stair_count: stairs in the falling half (default: the rising half's).
        decay_step_size: batches per decay interval ``k`` (0: no decay).
        cycle_momentum: cycle momentum inversely to the lr.
        cycle_min_mom: momentum at the peak lr.
        cycle_max_mom: momentum at the cycle's ends.
        decay_mom_rate: after the cycle, ``mom = cycle_max_mom * (1 + decay_mom_rate * k)``.
        last_batch_iteration: the last batch trained (-1 for a fresh start).

    Example:
        >>> sched = OneCycle(opt, cycle_min_lr=1e-4, cycle_max_lr=1e-3, cycle_first_step_size=500)
    """

    def __init__(  # DeepSpeed's parameter list, kept whole for drop-in configs
        self,
        optimizer: Optimizer,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        owner, n = "OneCycle", len(optimizer.param_groups)
        self.first_step_size = _check_int(
            f"{owner}.cycle_first_step_size", cycle_first_step_size, minimum=1
        )
        self.second_step_size = (
            self.first_step_size
            if cycle_second_step_size is None
            else _check_int(f"{owner}.cycle_second_step_size", cycle_second_step_size, minimum=1)
        )
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        # A count <= 0 keeps the half continuous (DeepSpeed's CLI default is -1).
        self.first_stair_count = _check_int(
            f"{owner}.cycle_first_stair_count", cycle_first_stair_count, minimum=-1
        )
        self.second_stair_count = (
            self.first_stair_count
            if cycle_second_stair_count is None
            else _check_int(
                f"{owner}.cycle_second_stair_count", cycle_second_stair_count, minimum=-1
            )
        )
        self.decay_step_size = _check_int(f"{owner}.decay_step_size", decay_step_size, minimum=0)
        self.min_lrs = _per_group(owner, "cycle_min_lr", cycle_min_lr, n)
        self.max_lrs = _per_group(owner, "cycle_max_lr", cycle_max_lr, n)
        self.decay_lr_rate = _check_number(f"{owner}.decay_lr_rate", decay_lr_rate)
        self.min_moms = _per_group(owner, "cycle_min_mom", cycle_min_mom, n)
        self.max_moms = _per_group(owner, "cycle_max_mom", cycle_max_mom, n)
        self.decay_mom_rate = _check_number(f"{owner}.decay_mom_rate", decay_mom_rate)
        self.momentum_key = self._momentum_key(optimizer) if cycle_momentum else None
        self.cycle_momentum = self.momentum_key is not None
        self._apply()

    @staticmethod
    def _momentum_key(optimizer: Optimizer) -> str | None:
        for key in ("betas", "momentum"):
            if key in optimizer.defaults:
                return key
        warnings.warn(
            f"OneCycle: cycle_momentum is off because {type(optimizer).__name__} has neither "
            "'betas' nor 'momentum' in its defaults",
            stacklevel=3,
        )
        return None

    def _scale_factor(self, batch_iteration: int) -> float:
        """Where in the cycle ``batch_iteration`` is: 0 at the ends, 1 at the peak."""
        position = batch_iteration + 1
        cycle = math.floor(1 + position / self.total_size)
        x = 1.0 + position / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # Quantise from the integer offset, not from ``scale``: the float scale at a
            # half-cycle boundary can land a hair under an exact stair and floor a stair low.
            offset = position % self.total_size
            if offset <= self.first_step_size:
                stair = offset * stairs / self.first_step_size
            else:
                stair = (self.total_size - offset) * stairs / self.second_step_size
            scale = math.floor(stair) / stairs
        return scale

    def _decay_interval(self, batch_iteration: int) -> float:
        return (batch_iteration - self.total_size + 1) / self.decay_step_size

    def lr_at(self, batch_iteration: int) -> list[float]:
        if batch_iteration < self.total_size:
            scale = self._scale_factor(batch_iteration)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            return list(self.min_lrs)
        factor = 1.0 + self.decay_lr_rate * self._decay_interval(batch_iteration)
        return [lo / factor for lo in self.min_lrs]

    def momentum_at(self, batch_iteration: int) -> list[float]:
        """The momentum (beta1) of every param group at ``batch_iteration``."""
        if batch_iteration < self.total_size:
            scale = self._scale_factor(batch_iteration)
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.decay_step_size == 0 or self.decay_mom_rate == 0:
            return list(self.max_moms)
        factor = 1.0 + self.decay_mom_rate * self._decay_interval(batch_iteration)
        return [hi * factor for hi in self.max_moms]

    def _apply(self) -> None:
        super()._apply()
        if self.momentum_key is None:
            return
        moms = self.momentum_at(self.last_batch_iteration)
        for group, mom in zip(self.optimizer.param_groups, moms, strict=True):
            if self.momentum_key == "betas":
                group["betas"] = (mom, *tuple(group["betas"])[1:])
            else:
                group["momentum"] = mom


class WarmupLR(_BatchScheduler):
    """Warm the lr up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold it.

    ``lr = min + (max - min) * gamma`` with ``gamma = log(it + 1) / log(N)`` (``log``) or
    ``it / N`` (``linear``) for ``it < N = max(2, warmup_num_steps)``, then 1.

    Args:
        optimizer: any torch optimizer.
        warmup_min_lr: lr at the start (per group or one for all).
        warmup_max_lr: lr after warmup; None takes each group's own lr.
        warmup_num_steps: batches of warmup.
        warmup_type: ``"log"`` or ``"linear"``.
        last_batch_iteration: the last batch trained (-1 for a fresh start).

    Example:
        >>> sched = WarmupLR(opt, warmup_max_lr=3e-4, warmup_num_steps=1000, warmup_type="linear")
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        owner, n = type(self).__name__, len(optimizer.param_groups)
        self.min_lrs = _per_group(owner, "warmup_min_lr", warmup_min_lr, n)
        self.max_lrs = (
            list(self.base_lrs)
            if warmup_max_lr is None
            else _per_group(owner, "warmup_max_lr", warmup_max_lr, n)
        )
        steps = _check_int(f"{owner}.warmup_num_steps", warmup_num_steps, minimum=1)
        self.warmup_num_steps = max(2, steps)  # log(1) = 0 would divide by zero
        self.warmup_type = _warmup_type(owner, warmup_type)
        self._finish_init()
        self._apply()

    def _finish_init(self) -> None:
        """Subclasses check their extra parameters here, before the first lr is set."""

    def _gamma(self, batch_iteration: int) -> float:
        if batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lr_at(self, batch_iteration: int) -> list[float]:
        if batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma(batch_iteration)
        return [float(lo + (hi - lo) * gamma) for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`, then a linear decay to 0 at ``total_num_steps``.

    After warmup, ``gamma = max(0, (total_num_steps - it) / max(1, total_num_steps - N))``.

    Args:
        optimizer: any torch optimizer.
        total_num_steps: the batch at which the lr reaches 0.
        warmup_min_lr: lr at the start (per group or one for all).
        warmup_max_lr: lr at the end of warmup.
        warmup_num_steps: batches of warmup.
        warmup_type: ``"log"`` or ``"linear"``.
        last_batch_iteration: the last batch trained (-1 for a fresh start).

    Example:
        >>> sched = WarmupDecayLR(opt, total_num_steps=10_000, warmup_max_lr=3e-4)
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = _check_int(
            "WarmupDecayLR.total_num_steps", total_num_steps, minimum=1
        )
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )

    def _finish_init(self) -> None:
        _warn_total_below_warmup("WarmupDecayLR", self.total_num_steps, self.warmup_num_steps)

    def _gamma(self, batch_iteration: int) -> float:
        if batch_iteration < self.warmup_num_steps:
            return super()._gamma(batch_iteration)
        remaining = self.total_num_steps - batch_iteration
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_BatchScheduler):
    """Warm up to each group's own lr, then a cosine decay to ``cos_min_ratio`` of it.

    The lr is ``base_lr * ratio``. During warmup ``ratio = warmup_min_ratio + (1 -
    warmup_min_ratio) * gamma`` (``gamma`` as in :class:`WarmupLR`); after it, with
    ``p = min(1, (it - N + 1) / max(1, total_num_steps - N))``,
    ``ratio = max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2)``.

    Args:
        optimizer: any torch optimizer; each group's lr is its peak.
        total_num_steps: the batch at which the cosine reaches ``cos_min_ratio``.
        warmup_min_ratio: the start of warmup, as a fraction of the peak lr.
        warmup_num_steps: batches of warmup.
        cos_min_ratio: the end of the cosine, as a fraction of the peak lr.
        warmup_type: ``"log"`` or ``"linear"``.
        last_batch_iteration: the last batch trained (-1 for a fresh start).

    Example:
        >>> sched = WarmupCosineLR(opt, total_num_steps=10_000, warmup_num_steps=500)
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        owner = "WarmupCosineLR"
        self.total_num_steps = _check_int(f"{owner}.total_num_steps", total_num_steps, minimum=1)
        self.warmup_min_ratio = _check_number(
            f"{owner}.warmup_min_ratio", warmup_min_ratio, minimum=0.0
        )
        steps = _check_int(f"{owner}.warmup_num_steps", warmup_num_steps, minimum=1)
        self.warmup_num_steps = max(2, steps)
        self.cos_min_ratio = _check_number(f"{owner}.cos_min_ratio", cos_min_ratio, minimum=0.0)
        self.warmup_type = _warmup_type(owner, warmup_type)
        _warn_total_below_warmup(owner, self.total_num_steps, self.warmup_num_steps)
        self._apply()

    def ratio_at(self, batch_iteration: int) -> float:
        """The fraction of each group's peak lr at ``batch_iteration``."""
        if batch_iteration < self.warmup_num_steps:
            # Before the first step (-1) the lr is warmup's start, as at iteration 0.
            gamma = _warmup_fraction(
                max(batch_iteration, 0), self.warmup_num_steps, self.warmup_type
            )
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * gamma
        done = batch_iteration - self.warmup_num_steps + 1
        progress = min(1.0, done / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr_at(self, batch_iteration: int) -> list[float]:
        ratio = self.ratio_at(batch_iteration)
        return [float(base * ratio) for base in self.base_lrs]


# --- the config section --------------------------------------------------------------------------

SCHEDULES: dict[str, type[_BatchScheduler]] = {
    cls.__name__: cls for cls in (LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR)
}


def _torch_schedulers() -> dict[str, type]:
    kinds = (LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    found = {}
    for name in dir(torch.optim.lr_scheduler):
        value = getattr(torch.optim.lr_scheduler, name)
        if isinstance(value, type) and issubclass(value, kinds) and value is not LRScheduler:
            found[name.lower()] = value
    return found


def _resolve(type_name: Any) -> type:
    """The class for a ``scheduler.type`` (any case): ours, else a torch.optim.lr_scheduler one."""
    if not isinstance(type_name, str):
        raise ConfigError(f"scheduler.type = {type_name!r}: expected a schedule name string")
    key = type_name.strip().lower()
    by_lower = {name.lower(): cls for name, cls in SCHEDULES.items()}
    if (cls := by_lower.get(key) or _torch_schedulers().get(key)) is not None:
        return cls
    close = closest(key, by_lower, cutoff=0.5)
    hint = f"did you mean {by_lower[close].__name__!r}? " if close else ""
    raise ConfigError(
        f"scheduler.type = {type_name!r} is not a known schedule; {hint}expected one of "
        f"{list(SCHEDULES)} (any case) or a torch.optim.lr_scheduler class name such as StepLR"
    )


def check_scheduler_section(type_name: Any, params: Any) -> tuple[str, dict[str, Any]]:
    """Validate a ``scheduler`` section's type and parameter names (not values).

    Returns:
        The canonical type name and a copy of the params.

    Raises:
        ConfigError: unknown type, a params key the schedule does not take, or a missing one.
    """
    cls = _resolve(type_name)
    if not isinstance(params, Mapping):
        raise ConfigError(f"scheduler.params = {params!r}: expected a mapping of parameters")
    signature = inspect.signature(cls)
    accepted = [name for name in signature.parameters if name != "optimizer"]
    check_keys(
        "scheduler.params",
        params,
        accepted,
        what=f"a parameter of {cls.__name__}",
        listing="it takes",
    )
    for name, parameter in signature.parameters.items():
        required = parameter.default is inspect.Parameter.empty and parameter.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            inspect.Parameter.KEYWORD_ONLY,
        )
        if required and name != "optimizer" and name not in params:
            raise ConfigError(f"scheduler.params.{name} is required by {cls.__name__}")
    return cls.__name__, dict(params)


def build_lr_scheduler(
    config: Mapping[str, Any] | SchedulerConfig, optimizer: Optimizer
) -> LRScheduler:
    """Build the scheduler a DeepSpeed ``scheduler`` section describes, on ``optimizer``.

    ``type`` is one of ``LRRangeTest``, ``OneCycle``, ``WarmupLR``, ``WarmupDecayLR``,
    ``WarmupCosineLR`` (any case), or, as in DeepSpeed, a ``torch.optim.lr_scheduler`` class
    name; ``params`` are its constructor's keyword arguments.

    Example:
        >>> sched = build_lr_scheduler(
        ...     {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 100}},
        ...     optimizer,
        ... )
    """
    section = config if isinstance(config, SchedulerConfig) else SchedulerConfig.from_dict(config)
    cls = _resolve(section.type)
    return cls(optimizer, **section.params)
