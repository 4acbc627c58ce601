"""ZeRO stages 0-3 over a data-parallel group: sharded optimizer state, gradients and (stage 3)
parameters, overlapped reductions, prefetched gathers, CPU/NVMe offload, reshardable sharded
checkpoints and memory accounting."""

from __future__ import annotations

from ds_zero._checkpoint import (
    load_sharded_checkpoint,
    recover_directory,
    repair_directory,
    replace_dir,
    save_fsynced,
    save_sharded_checkpoint,
    verify_checkpoint,
)
from ds_zero._consolidate import (
    CheckpointView,
    LazyFp32Tensor,
    consolidate,
    iter_fp32_tensors,
    lazy_fp32_state_dict,
    write_recovery_script,
)
from ds_zero._factory import build_zero_optimizer
from ds_zero._init import (
    GatheredParameters,
    Init,
    register_external_parameter,
    unregister_external_parameter,
)
from ds_zero._integrity import (
    CheckpointError,
    PendingVerification,
    load_file,
    read_json,
    start_verification,
    verify_directory,
    write_directory_manifest,
)
from ds_zero._leaf import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)
from ds_zero._local import SelfReducingStep
from ds_zero._memory import (
    estimate_model_states,
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states,
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
    model_states_table,
)
from ds_zero._optimizer import ZeroOptimizer
from ds_zero._param_access import ParamViews, param_views
from ds_zero._param_offload import NvmeShardStore
from ds_zero._partitioned import GatherHandle, ParamPartitioner, ShardStore, ZeroParamStatus
from ds_zero._safetensors import export_safetensors
from ds_zero._shards import ShardLookup, TensorShard
from ds_zero._stage3 import PrefetchStats
from ds_zero._stage3_optimizer import Stage3Optimizer
from ds_zero._state_offload import (
    offload_states,
    offloaded_states,
    reload_states,
    resident_state_bytes,
    state_tensors,
)
from ds_zero.api import (
    ConfigError,
    MemoryBreakdown,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    OffloadStateTypeEnum,
    TensorSwapper,
    ZeroConfig,
)

__version__ = "0.3.0"

__all__ = [
    # config
    "ZeroConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "ConfigError",
    # training
    "ZeroOptimizer",
    "SelfReducingStep",
    "TensorSwapper",
    # stage 3
    "Stage3Optimizer",
    "build_zero_optimizer",
    "PrefetchStats",
    "ParamPartitioner",
    "ZeroParamStatus",
    "GatherHandle",
    "ShardStore",
    "Init",
    "GatheredParameters",
    "register_external_parameter",
    "unregister_external_parameter",
    "NvmeShardStore",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "z3_leaf_module",
    "z3_leaf_parameter",
    # parameter access (DeepSpeed's safe_get_full_fp32_param and siblings)
    "ParamViews",
    "param_views",
    # checkpoints
    "save_sharded_checkpoint",
    "load_sharded_checkpoint",
    "save_fsynced",
    "replace_dir",
    "verify_checkpoint",
    "verify_directory",
    "start_verification",
    "PendingVerification",
    "write_directory_manifest",
    "recover_directory",
    "repair_directory",
    "load_file",
    "read_json",
    "CheckpointError",
    "TensorShard",
    "ShardLookup",
    "consolidate",
    "iter_fp32_tensors",
    "lazy_fp32_state_dict",
    "LazyFp32Tensor",
    "CheckpointView",
    "write_recovery_script",
    "export_safetensors",
    # memory
    "MemoryBreakdown",
    "estimate_model_states",
    "estimate_zero3_model_states",
    "model_states_table",
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    # state offload between training phases (DeepSpeed's offload_states / reload_states)
    "OffloadStateTypeEnum",
    "offload_states",
    "reload_states",
    "offloaded_states",
    "resident_state_bytes",
    "state_tensors",
    "__version__",
]
