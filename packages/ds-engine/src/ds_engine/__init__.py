"""initialize(), the training engine and config: the ds_engine namespace.

``import ds_engine as deepspeed`` runs DeepSpeed-style scripts, and the opt-in ``deepspeed``
distribution maps every ``deepspeed.X`` path onto ``ds_engine.X``. The namespace offers
DeepSpeed's module paths (``runtime.zero``, ``runtime.pipe``, ``ops.op_builder``, ``utils``,
``accelerator``, ...); each is a thin re-export of the ds package that owns the behaviour.
Submodules load on first attribute access (``deepspeed.utils``), so importing the namespace does
not import every package behind it.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

# --- entry points ---
# isort: split
from ds_comm import init_distributed
from ds_engine._initialize import add_config_arguments, initialize

# --- engine, loader, config ---
# isort: split
from ds_engine._engine import DeepSpeedEngine
from ds_engine._loader import DeepSpeedDataLoader
from ds_engine._progress import numerics_table
from ds_engine.api import ConfigError, DeepSpeedConfig, config_json_schema

# The deepspeed namespace: submodules imported on first attribute access.
_SUBMODULES = frozenset(
    {
        "accelerator",
        "checkpoint",
        "checkpointing",
        "comm",
        "env_report",
        "launcher",
        "moe",
        "monitor",
        "ops",
        "pipe",
        "profiling",
        "runtime",
        "sequence",
        "utils",
        "zero",
    }
)
# DeepSpeed's top-level names that live in a submodule: name -> module (imported on first use).
_LAZY_NAMES = {
    "DeepSpeedConfigError": "ds_engine.runtime.config",
    "DeepSpeedOptimizer": "ds_engine.runtime.base_optimizer",
    "PipelineEngine": "ds_engine.runtime.pipe.engine",
    "PipelineModule": "ds_engine.pipe",
    "get_accelerator": "ds_engine.accelerator",
    "log_dist": "ds_engine.utils",
    "logger": "ds_engine.utils",
    "OnDevice": "ds_engine.utils",
    "tp_model_init": "ds_engine._autotp",
    "gather_tp_state_dict": "ds_engine._autotp",
}
# DeepSpeed's top-level names for features ds does not implement: callables that refuse.
_NOT_IMPLEMENTED = {
    "init_inference": "DeepSpeed-Inference (kernel injection, inference engine)",
    "default_inference_config": "DeepSpeed-Inference (kernel injection, inference engine)",
}

__all__ = [
    # entry points
    "initialize",
    "add_config_arguments",
    "init_distributed",
    # engine, loader, config
    "DeepSpeedEngine",
    "DeepSpeedDataLoader",
    "DeepSpeedConfig",
    "ConfigError",
    "config_json_schema",
    "numerics_table",
    # the deepspeed namespace (lazy)
    "DeepSpeedConfigError",
    "DeepSpeedOptimizer",
    "PipelineEngine",
    "PipelineModule",
    "get_accelerator",
    "log_dist",
    "logger",
    "OnDevice",
    "tp_model_init",
    "gather_tp_state_dict",
    *sorted(_SUBMODULES),
    "__version__",
]


def __getattr__(name: str) -> Any:
    # Import on first use: ``deepspeed.moe`` / ``deepspeed.pipe`` need optional packages and fail
    # only where they are used, with the pip command to run.
    if name in _SUBMODULES:
        return importlib.import_module(f"ds_engine.{name}")
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    if name in _NOT_IMPLEMENTED:
        from ds_engine._not_implemented import not_implemented

        return not_implemented(f"deepspeed.{name}", _NOT_IMPLEMENTED[name])
    raise AttributeError(f"module 'ds_engine' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_SUBMODULES, *_LAZY_NAMES, *_NOT_IMPLEMENTED})
