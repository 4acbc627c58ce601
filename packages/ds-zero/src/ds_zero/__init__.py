"""ZeRO stages 0-2 over a data-parallel group: sharded optimizer state and gradients, overlapped
reductions, CPU offload, elastic sharded checkpoints and memory accounting."""

from __future__ import annotations

from ds_zero._checkpoint import (
    load_sharded_checkpoint,
    replace_dir,
    save_fsynced,
    save_sharded_checkpoint,
)
from ds_zero._memory import (
    estimate_model_states,
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    model_states_table,
)
from ds_zero._optimizer import ZeroOptimizer
from ds_zero.api import (
    ConfigError,
    MemoryBreakdown,
    OffloadOptimizerConfig,
    TensorSwapper,
    ZeroConfig,
)

__version__ = "0.1.0"

__all__ = [
    # config
    "ZeroConfig",
    "OffloadOptimizerConfig",
    "ConfigError",
    # training
    "ZeroOptimizer",
    "TensorSwapper",
    # checkpoints
    "save_sharded_checkpoint",
    "load_sharded_checkpoint",
    "save_fsynced",
    "replace_dir",
    # memory
    "MemoryBreakdown",
    "estimate_model_states",
    "model_states_table",
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "__version__",
]
