"""Optimizers, LR schedules, loss scaling and gradient clipping."""

from __future__ import annotations

# --- optimizers: adam (FusedAdam, CPUAdam) ---
# isort: split
from ds_optim._cpu_adam import CPUAdam
from ds_optim._fused_adam import FusedAdam

# --- optimizers: lamb, lion, adagrad, registry ---
# isort: split
from ds_optim._adagrad import Adagrad
from ds_optim._lamb import FusedLamb, Lamb
from ds_optim._lion import Lion
from ds_optim._registry import build_optimizer, register_optimizer
from ds_optim.api import OptimizerConfig

# --- optimizers: communication-efficient (1-bit) ---
# isort: split
from ds_optim._onebit_adam import OneBitAdam
from ds_optim._onebit_lamb import OneBitLamb
from ds_optim._zero_one_adam import ZeroOneAdam

# --- LR schedules ---
# isort: split
from ds_optim._lr_plot import plot_lr_range_test
from ds_optim._lr_schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_lr_scheduler,
)
from ds_optim.api import LRRangeTestMarks, SchedulerConfig

# --- mixed precision: loss scaling, grad norm, clipping ---
# isort: split
from ds_optim._grad_norm import clip_grad_norm_, global_grad_norm
from ds_optim._loss_scaler import (
    DynamicLossScaler,
    StaticLossScaler,
    build_loss_scaler,
    has_overflow,
)
from ds_optim.api import BF16Config, FP16Config, LossScaleAtMinimumError

# --- the gradient step the engines drive ---
# isort: split
from ds_optim._step import GradientStep, StepResult

__version__ = "0.2.0"

__all__ = [
    # optimizers: adam
    "FusedAdam",
    "CPUAdam",
    # optimizers: lamb, lion, adagrad, registry
    "FusedLamb",
    "Lamb",
    "Lion",
    "Adagrad",
    "OptimizerConfig",
    "build_optimizer",
    "register_optimizer",
    # optimizers: communication-efficient (1-bit)
    "OneBitAdam",
    "ZeroOneAdam",
    "OneBitLamb",
    # LR schedules
    "LRRangeTest",
    "OneCycle",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "build_lr_scheduler",
    "SchedulerConfig",
    "plot_lr_range_test",
    "LRRangeTestMarks",
    # mixed precision: loss scaling, grad norm, clipping
    "FP16Config",
    "BF16Config",
    "DynamicLossScaler",
    "StaticLossScaler",
    "build_loss_scaler",
    "has_overflow",
    "LossScaleAtMinimumError",
    "global_grad_norm",
    "clip_grad_norm_",
    # the gradient step the engines drive
    "GradientStep",
    "StepResult",
    "__version__",
]
