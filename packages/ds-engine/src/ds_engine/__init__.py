"""initialize(), the training engine and config: the ds_engine namespace.

``import ds_engine as deepspeed`` runs DeepSpeed-style scripts: ``deepspeed.initialize``,
``deepspeed.comm``, ``deepspeed.ops.adam``, ``deepspeed.runtime.lr_schedules``, ``deepspeed.zero``
and, when ds-moe / ds-pipe are installed, ``deepspeed.moe`` / ``deepspeed.pipe``.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

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

# --- the deepspeed namespace (submodules) ---
# isort: split
from ds_engine import comm, ops, runtime, zero

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
    # the deepspeed namespace
    "comm",
    "ops",
    "runtime",
    "zero",
    "__version__",
]

_OPTIONAL_SUBMODULES = ("moe", "pipe")


def __getattr__(name: str) -> Any:
    # deepspeed.moe / deepspeed.pipe need optional packages: import on first use, so a missing
    # one fails only where it is used, with the pip command to run.
    if name in _OPTIONAL_SUBMODULES:
        return importlib.import_module(f"ds_engine.{name}")
    raise AttributeError(f"module 'ds_engine' has no attribute {name!r}")
