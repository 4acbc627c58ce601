"""``deepspeed.utils``: logging, process groups, parameter access across ZeRO partitions
(``safe_get_full_fp32_param`` and siblings), ZeRO-3 leaf modules, ``OnDevice``,
``RepeatingLoader``, timers and ``zero_to_fp32``."""

from __future__ import annotations

# --- logging ---
# isort: split
from ds_engine.utils.logging import (
    get_caller_func,
    log_dist,
    log_dist_once,
    logger,
    print_json_dist,
    set_log_level_from_string,
)

# --- tensors, modules, data ---
# isort: split
from ds_engine.utils import groups
from ds_engine.utils._repeating import RepeatingLoader
from ds_engine.utils.init_on_device import OnDevice
from ds_engine.utils.module_utils import recursive_getattr, recursive_setattr
from ds_engine.utils.nvtx import instrument_w_nvtx
from ds_engine.utils.tensor_fragment import (
    get_full_hp_grad,
    get_full_hp_param,
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
    set_full_hp_grad,
    set_full_hp_param,
)
from ds_engine.utils.z3_leaf_module import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

__all__ = [
    # logging
    "logger",
    "log_dist",
    "log_dist_once",
    "print_json_dist",
    "set_log_level_from_string",
    "get_caller_func",
    # process groups
    "groups",
    # parameter access across ZeRO partitions
    "safe_get_full_fp32_param",
    "safe_set_full_fp32_param",
    "safe_get_full_optimizer_state",
    "safe_set_full_optimizer_state",
    "safe_get_full_grad",
    "safe_set_full_grad",
    "safe_update_full_grad_vectorized",
    "safe_get_local_fp32_param",
    "safe_set_local_fp32_param",
    "safe_get_local_optimizer_state",
    "safe_set_local_optimizer_state",
    "safe_get_local_grad",
    "safe_set_local_grad",
    "get_full_hp_param",
    "set_full_hp_param",
    "get_full_hp_grad",
    "set_full_hp_grad",
    # ZeRO-3 leaf modules
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "z3_leaf_module",
    "z3_leaf_parameter",
    # modules, data, profiling
    "OnDevice",
    "RepeatingLoader",
    "recursive_getattr",
    "recursive_setattr",
    "instrument_w_nvtx",
]
