"""Public types of ds-optim: config sections, errors and protocols.

Each section below is owned by one part of the package; config models are frozen keyword-only
dataclasses with DeepSpeed's key names and defaults, validated in ``__post_init__``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ds_comm import ConfigError
from ds_comm.api import as_section, check_keys, is_auto, without_auto

__all__ = [
    "ConfigError",
    # optimizer section
    "OptimizerConfig",
    # scheduler section
    "SchedulerConfig",
    "LRRangeTestMarks",
    # mixed precision
    "FP16Config",
    "BF16Config",
    "LossScaleAtMinimumError",
]

# --- optimizer section (registry) ---


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The ``optimizer`` section: ``{"type": "AdamW", "params": {"lr": 3e-4}}``.

    Attributes:
        type: ``Adam``, ``AdamW``, ``Lamb``, ``OneBitAdam``, ``ZeroOneAdam``, ``OneBitLamb``,
            ``Lion``, ``Adagrad``, ``SGD``, a type added with ``register_optimizer``, or a
            ``torch.optim`` class name; any case (stored in the registry's case). DeepSpeed's
            ``Adam`` decays weights decoupled (AdamW) unless ``params.adam_w_mode`` is false.
        params: the optimizer's constructor arguments (plus ``torch_adam`` and ``adam_w_mode``
            for Adam/AdamW). Names are checked here against the type's constructors (unknown
            ones are errors); values when the optimizer is built.
    """

    type: str
    params: Mapping[str, Any] = field(default_factory=dict)
    legacy_fusion: bool = False

    def __post_init__(self) -> None:
        # The optimizers' signatures are the source of truth for their parameter names.
        from ds_optim._registry import check_optimizer_section

        canonical, params = check_optimizer_section(self.type, self.params)
        object.__setattr__(self, "type", canonical)
        object.__setattr__(self, "params", params)
        _check_bools("optimizer", self, ("legacy_fusion",))
        if self.legacy_fusion:
            raise ConfigError(
                "optimizer.legacy_fusion = true asks for DeepSpeed's legacy fused fp16 optimizer, "
                "which is not implemented in ds; remove it (false)"
            )

    def resolved_params(self) -> dict[str, Any]:
        """``params`` for building the optimizer; a value still ``"auto"`` is an error.

        Raises:
            ConfigError: naming every ``"auto"`` left (see :func:`unresolved_auto`).
        """
        return _resolved("optimizer", self.params)

    @classmethod
    def from_dict(cls, section: Mapping[str, Any]) -> OptimizerConfig:
        """Build from the JSON ``optimizer`` section (``params`` values may be ``"auto"``
        until the optimizer is built, as Hugging Face clients fill them in)."""
        values = _known_keys("optimizer", section, ("type", "params", "legacy_fusion"))
        if "type" not in values:
            raise ConfigError('optimizer.type is missing: name an optimizer, e.g. "AdamW"')
        if values.get("params") is None:
            values["params"] = {}
        return cls(**values)


def _resolved(section_name: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``params``; ConfigError naming the keys whose value is still ``"auto"``."""
    left = [k for k, v in params.items() if is_auto(v)]
    if left:
        keys = ", ".join(f"{section_name}.params.{k}" for k in left)
        raise ConfigError(
            f'{keys} = "auto": a placeholder that Hugging Face transformers/accelerate replace '
            "before deepspeed.initialize; it reached the optimizer unresolved. Set a value, or "
            "let the client fill it in (e.g. Trainer with TrainingArguments(deepspeed=...))"
        )
    return dict(params)


# --- scheduler section (LR schedules) ---


def _known_keys(section_name: str, section: Any, known: tuple[str, ...]) -> dict[str, Any]:
    """A copy of a JSON section; a key not in ``known`` is a ConfigError with a suggestion."""
    values = as_section(section_name, section)
    check_keys(section_name, values, known)
    return values


def _check_number(key: str, value: Any, *, minimum: float | None = None) -> float:
    """``value`` as a finite float not below ``minimum``; else a ConfigError naming ``key``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (minimum is not None and value < minimum):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ConfigError(f"{key} = {value!r}: expected a finite number{bound}")
    return float(value)


def _check_int(key: str, value: Any, *, minimum: int, maximum: int | None = None) -> int:
    """``value`` as an integer in ``[minimum, maximum]``; else a ConfigError naming ``key``."""
    too_big = maximum is not None and isinstance(value, int) and value > maximum
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum or too_big:
        bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
        raise ConfigError(f"{key} = {value!r}: expected an integer {bound}")
    return value


def _check_bools(section_name: str, config: Any, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, bool):
            raise ConfigError(f"{section_name}.{name} = {value!r}: expected true or false")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The ``scheduler`` section: ``{"type": "WarmupLR", "params": {...}}``.

    Attributes:
        type: ``LRRangeTest``, ``OneCycle``, ``WarmupLR``, ``WarmupDecayLR`` or
            ``WarmupCosineLR`` in any case (stored in this case), or, as in DeepSpeed, a
            ``torch.optim.lr_scheduler`` class name.
        params: the schedule's constructor arguments, with DeepSpeed's names. Names are checked
            here (unknown or missing ones are errors); values when the schedule is built.
    """

    type: str
    params: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The schedules' signatures are the source of truth for their parameter names.
        from ds_optim._lr_schedules import check_scheduler_section

        canonical, params = check_scheduler_section(self.type, self.params)
        object.__setattr__(self, "type", canonical)
        object.__setattr__(self, "params", params)

    def resolved_params(self) -> dict[str, Any]:
        """``params`` for building the schedule; a value still ``"auto"`` is an error."""
        return _resolved("scheduler", self.params)

    @classmethod
    def from_dict(cls, section: Mapping[str, Any]) -> SchedulerConfig:
        """Build from the JSON ``scheduler`` section."""
        values = _known_keys("scheduler", section, ("type", "params"))
        if "type" not in values:
            raise ConfigError('scheduler.type is missing: name a schedule, e.g. "WarmupLR"')
        if values.get("params") is None:
            values["params"] = {}
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class LRRangeTestMarks:
    """What :func:`ds_optim.plot_lr_range_test` drew and marked.

    Attributes:
        path: the PNG written.
        steepest_lr: where the smoothed loss falls fastest against log(lr); a usual pick for
            the peak lr (e.g. OneCycle's ``cycle_max_lr``).
        min_loss_lr: where the smoothed loss is lowest; the lr is too high past this point.
    """

    path: Path
    steepest_lr: float
    min_loss_lr: float


# --- mixed precision (fp16 / loss scaling) ---

# Switches of DeepSpeed's precision sections for features ds does not implement: false (their
# default here) asks for nothing; true is refused, naming the feature.
_FP16_NOT_IMPLEMENTED = {"fp16_master_weights_and_grads": "fp16 master weights and gradients"}
_BF16_NOT_IMPLEMENTED = {
    "immediate_grad_update": "immediate gradient updates of the master weights",
    "check_grad_overflow": "bf16 gradient overflow checks (skipped steps)",
    "bf16_master_weights_and_grads": "bf16 master weights and gradients",
    "bf16_optimizer_states": "bf16 optimizer states",
}


def _refuse_when_true(section_name: str, config: Any, table: Mapping[str, str]) -> None:
    for name, feature in table.items():
        if getattr(config, name):
            raise ConfigError(
                f"{section_name}.{name} = true asks for {feature}, which is not implemented in "
                "ds; set it to false or remove it"
            )


class LossScaleAtMinimumError(RuntimeError):
    """Gradients overflowed with the dynamic loss scale already at ``min_loss_scale``."""


@dataclass(frozen=True, kw_only=True)
class FP16Config:
    """The ``fp16`` section (DeepSpeed's keys and defaults).

    Attributes:
        enabled: train in fp16 with loss scaling.
        auto_cast: cast the model's floating-point inputs to fp16 (applied by ds-engine).
        loss_scale: 0 selects dynamic loss scaling; any other value is a static scale.
        initial_scale_power: dynamic scaling starts at ``2**initial_scale_power``.
        loss_scale_window: overflow-free steps after which the dynamic scale doubles.
        hysteresis: overflows absorbed before the scale is halved (DeepSpeed's delayed shift).
        consecutive_hysteresis: refill the hysteresis after every overflow-free step, not
            only when the scale doubles.
        min_loss_scale: the floor of the dynamic scale.
        fp16_master_weights_and_grads: fp16 master weights and grads (DeepSpeed: with CPU
            Adam); not implemented in ds (true is refused).
    """

    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    fp16_master_weights_and_grads: bool = False

    def __post_init__(self) -> None:
        bools = ("enabled", "auto_cast", "consecutive_hysteresis", "fp16_master_weights_and_grads")
        _check_bools("fp16", self, bools)
        _refuse_when_true("fp16", self, _FP16_NOT_IMPLEMENTED)
        loss_scale = _check_number("fp16.loss_scale", self.loss_scale, minimum=0.0)
        object.__setattr__(self, "loss_scale", loss_scale)
        # The scale must stay finite in fp32 (2**127 is its largest power of two).
        _check_int("fp16.initial_scale_power", self.initial_scale_power, minimum=0, maximum=127)
        _check_int("fp16.loss_scale_window", self.loss_scale_window, minimum=1)
        _check_int("fp16.hysteresis", self.hysteresis, minimum=1)
        min_scale = _check_number("fp16.min_loss_scale", self.min_loss_scale, minimum=0.0)
        if min_scale == 0.0:
            raise ConfigError("fp16.min_loss_scale = 0: expected a positive number, e.g. 1")
        object.__setattr__(self, "min_loss_scale", min_scale)

    @property
    def dynamic_loss_scale(self) -> bool:
        """True when ``loss_scale`` is 0 (DeepSpeed's switch to dynamic scaling)."""
        return self.loss_scale == 0.0

    @property
    def initial_dynamic_scale(self) -> int:
        """``2**initial_scale_power``: where dynamic scaling starts (DeepSpeed's name)."""
        return 2**self.initial_scale_power

    @property
    def dynamic_loss_scale_args(self) -> dict[str, Any]:
        """DeepSpeed's ``dynamic_loss_scale_args()``: the dynamic scaler's settings under its
        argument names (``init_scale``, ``scale_window``, ``delayed_shift``, ...)."""
        return {
            "init_scale": self.initial_dynamic_scale,
            "scale_window": self.loss_scale_window,
            "delayed_shift": self.hysteresis,
            "consecutive_hysteresis": self.consecutive_hysteresis,
            "min_scale": self.min_loss_scale,
        }

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> FP16Config:
        """Build from the JSON ``fp16`` section; unknown keys are errors with a suggestion and
        ``"auto"`` is a key's default (``"enabled": "auto"`` is off, as in DeepSpeed)."""
        return cls(**without_auto(_known_keys("fp16", section, tuple(f.name for f in fields(cls)))))


@dataclass(frozen=True, kw_only=True)
class BF16Config:
    """The ``bf16`` section (DeepSpeed's keys and defaults). bf16 needs no loss scaling.

    Attributes:
        enabled: train in bf16.
        immediate_grad_update: apply each gradient to the fp32 master copy as it is reduced.
        check_grad_overflow: check bf16 gradients for inf/nan and skip such steps (DeepSpeed
            0.19 defaults it to true; ds steps without the check, so its default is false).
        bf16_master_weights_and_grads: keep master weights and grads in bf16.
        bf16_optimizer_states: keep optimizer states in bf16 too; needs
            ``bf16_master_weights_and_grads``.

    ds keeps fp32 master weights and does not implement the four switches above: true is
    refused (see :data:`_BF16_NOT_IMPLEMENTED`).
    """

    enabled: bool = False
    immediate_grad_update: bool = False
    check_grad_overflow: bool = False
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False

    def __post_init__(self) -> None:
        _check_bools("bf16", self, tuple(f.name for f in fields(self)))
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise ConfigError(
                "bf16.bf16_optimizer_states = true needs bf16.bf16_master_weights_and_grads = "
                "true; set both or neither"
            )
        _refuse_when_true("bf16", self, _BF16_NOT_IMPLEMENTED)

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> BF16Config:
        """Build from the JSON ``bf16`` section; unknown keys are errors with a suggestion and
        ``"auto"`` is a key's default."""
        return cls(**without_auto(_known_keys("bf16", section, tuple(f.name for f in fields(cls)))))
