"""DeepSpeed's config accessors as data: accessor name -> dotted path of its field.

``engine.zero_reduce_bucket_size()`` & co. only return a config value. This table says where
each value lives in a parsed :class:`ds_engine.DeepSpeedConfig` (attributes, then keys of a
mapping such as ``zero_optimization.unimplemented``); the engine turns every row into a method.
Values DeepSpeed derives are properties of the models (``dynamic_loss_scale()`` is
``fp16.dynamic_loss_scale``, ``loss_scale == 0``); accessors that read optional sections
(``optimizer_name()``) or runtime state (``zero_nvme_offload_optimizer()``) are not rows: the
engine writes them out.

Paths start at the config object and read typed fields: resolve each part with ``getattr``
first, and index only objects without that attribute (``DeepSpeedConfig`` is itself a mapping
over the user's raw dict, whose keys are not the typed values).
"""

from __future__ import annotations

__all__ = ["DEEPSPEED_ACCESSORS"]

_ZERO = "zero_optimization"
_ZERO_UNIMPLEMENTED = f"{_ZERO}.unimplemented"
_FEATURES = "unimplemented"

DEEPSPEED_ACCESSORS: dict[str, str] = {
    # batch size, logging, clipping
    "train_batch_size": "train_batch_size",
    "train_micro_batch_size_per_gpu": "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "steps_per_print": "steps_per_print",
    "wall_clock_breakdown": "wall_clock_breakdown",
    "memory_breakdown": "memory_breakdown",
    "gradient_predivide_factor": "gradient_predivide_factor",
    "postscale_gradients": "postscale_gradients",
    "zero_allow_untested_optimizer": "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer": "zero_force_ds_cpu_optimizer",
    "dataloader_drop_last": "dataloader_drop_last",
    "dump_state": "dump_state",
    "log_level": "log_level",
    "aio_config": "aio",
    # mixed precision
    "fp16_enabled": "fp16.enabled",
    "fp16_auto_cast": "fp16.auto_cast",
    "loss_scale": "fp16.loss_scale",
    "dynamic_loss_scale": "fp16.dynamic_loss_scale",
    "initial_dynamic_scale": "fp16.initial_dynamic_scale",
    "dynamic_loss_scale_args": "fp16.dynamic_loss_scale_args",
    "fp16_master_weights_and_gradients": "fp16.fp16_master_weights_and_grads",
    "bfloat16_enabled": "bf16.enabled",
    "bf16_master_weights_and_gradients": "bf16.bf16_master_weights_and_grads",
    "bf16_optimizer_states": "bf16.bf16_optimizer_states",
    # checkpoint
    "checkpoint_tag_validation_enabled": "checkpoint.tag_validation_enabled",
    "checkpoint_tag_validation_fail": "checkpoint.tag_validation_fail",
    "load_universal_checkpoint": "checkpoint.load_universal",
    "use_node_local_storage": "checkpoint.use_node_local_storage",
    "checkpoint_serialization_enabled": "checkpoint.checkpoint_serialization",
    "checkpoint_writer_enabled": "checkpoint.writer_enabled",
    # ZeRO
    "zero_optimization_stage": f"{_ZERO}.stage",
    "zero_optimization": f"{_ZERO}.shard_optimizer_state",
    "zero_optimization_partition_gradients": f"{_ZERO}.shard_gradients",
    "zero_optimization_partition_weights": f"{_ZERO}.shard_parameters",
    "zero_use_cpu_optimizer": f"{_ZERO}.offload_optimizer.enabled",
    "zero_contiguous_gradients": f"{_ZERO}.contiguous_gradients",
    "zero_reduce_scatter": f"{_ZERO}.reduce_scatter",
    "zero_reduce_bucket_size": f"{_ZERO}.reduce_bucket_size",
    "zero_multi_rank_bucket_allreduce": f"{_ZERO}.use_multi_rank_bucket_allreduce",
    "zero_allgather_partitions": f"{_ZERO}.allgather_partitions",
    "zero_allgather_bucket_size": f"{_ZERO}.allgather_bucket_size",
    "zero_overlap_comm": f"{_ZERO}.overlap_comm",
    "zero_round_robin_gradients": f"{_ZERO}.round_robin_gradients",
    "zero_offload_optimizer": f"{_ZERO}.offload_optimizer_if_enabled",
    "zero_offload_param": f"{_ZERO}.offload_param_if_enabled",
    "zero_quantized_weights": f"{_ZERO}.zero_quantized_weights",
    "zero_quantized_gradients": f"{_ZERO}.zero_quantized_gradients",
    "zero_hpz_partition_size": f"{_ZERO}.zero_hpz_partition_size",
    "zero_partial_offload": f"{_ZERO}.offload_optimizer.ratio",
    "super_offload": f"{_ZERO}.offload_optimizer.super_offload",
    "cpuadam_cores_perc": f"{_ZERO}.offload_optimizer.cpuadam_cores_perc",
    "zero_elastic_checkpoint": f"{_ZERO}.elastic_checkpoint",
    "zero_load_from_fp32_weights": f"{_ZERO}.load_from_fp32_weights",
    "zero_ignore_unused_parameters": f"{_ZERO}.ignore_unused_parameters",
    "zero_sub_group_size": f"{_ZERO}.sub_group_size",
    "zero_prefetch_bucket_size": f"{_ZERO}.stage3_prefetch_bucket_size",
    "zero_param_persistence_threshold": f"{_ZERO}.stage3_param_persistence_threshold",
    "zero_max_live_parameters": f"{_ZERO}.stage3_max_live_parameters",
    "zero_max_reuse_distance": f"{_ZERO}.stage3_max_reuse_distance",
    "zero_gather_16bit_weights_on_model_save": (
        f"{_ZERO}.stage3_gather_16bit_weights_on_model_save"
    ),
    # data efficiency: curriculum learning (legacy and data sampling), progressive layer drop
    "curriculum_enabled_legacy": "curriculum_learning.enabled",
    "curriculum_params_legacy": "curriculum_learning.params",
    "pld_enabled": "progressive_layer_drop.enabled",
    "pld_params": "progressive_layer_drop.params",
    "pld_theta": "progressive_layer_drop.theta",
    "pld_gamma": "progressive_layer_drop.gamma",
    "data_efficiency_enabled": "data_efficiency.enabled",
    "data_efficiency_config": "data_efficiency.tree",
    "data_sampling_enabled": "data_efficiency.data_sampling.enabled",
    "data_sampling_config": "data_efficiency.data_sampling",
    "curriculum_learning_enabled": "data_efficiency.data_sampling.curriculum_learning.enabled",
    "curriculum_learning_config": "data_efficiency.data_sampling.curriculum_learning",
    "random_ltd_enabled": "data_efficiency.data_routing.random_ltd.enabled",
    "random_ltd_config": "data_efficiency.data_routing.random_ltd",
    # ZeRO keys of features ds does not implement (always DeepSpeed's defaults)
    "zero_model_persistence_threshold": f"{_ZERO_UNIMPLEMENTED}.model_persistence_threshold",
    "zero_module_granularity_threshold": f"{_ZERO_UNIMPLEMENTED}.module_granularity_threshold",
    "zero_allgather_sequential": f"{_ZERO_UNIMPLEMENTED}.allgather_sequential",
    "zero_quantized_nontrainable_weights": (
        f"{_ZERO_UNIMPLEMENTED}.zero_quantized_nontrainable_weights"
    ),
    "zero_legacy_stage1": f"{_ZERO_UNIMPLEMENTED}.legacy_stage1",
    "zero_log_trace_cache_warnings": f"{_ZERO_UNIMPLEMENTED}.log_trace_cache_warnings",
    "zero_parameter_alignment": f"{_ZERO_UNIMPLEMENTED}.parameter_alignment",
    "zero_compute_grad_norm": f"{_ZERO_UNIMPLEMENTED}.compute_grad_norm",
    "zero_save_muon_momentum_buffer_in_memory": (
        f"{_ZERO_UNIMPLEMENTED}.save_muon_momentum_buffer_in_memory"
    ),
    "zenflow_config": f"{_ZERO_UNIMPLEMENTED}.zenflow",
    "is_sanity_checks_enabled": f"{_ZERO_UNIMPLEMENTED}.enable_sanity_checks",
    # flops profiler
    "flops_profiler_enabled": "flops_profiler.enabled",
    "flops_profiler_recompute_fwd_factor": "flops_profiler.recompute_fwd_factor",
    "flops_profiler_profile_step": "flops_profiler.profile_step",
    "flops_profiler_module_depth": "flops_profiler.module_depth",
    "flops_profiler_top_modules": "flops_profiler.top_modules",
    "flops_profiler_detailed": "flops_profiler.detailed",
    "flops_profiler_output_file": "flops_profiler.output_file",
    # top-level features ds does not implement (inert values only)
    "autotuning_enabled": f"{_FEATURES}.autotuning.enabled",
    "autotuning_start_profile_step": f"{_FEATURES}.autotuning.start_profile_step",
    "autotuning_end_profile_step": f"{_FEATURES}.autotuning.end_profile_step",
    "autotuning_metric": f"{_FEATURES}.autotuning.metric",
    "torch_autocast_enabled": f"{_FEATURES}.torch_autocast.enabled",
    "torch_autocast_dtype": f"{_FEATURES}.torch_autocast.dtype",
    "torch_autocast_lower_precision_safe_modules": (
        f"{_FEATURES}.torch_autocast.lower_precision_safe_modules"
    ),
    "tensor_parallel_config": f"{_FEATURES}.tensor_parallel",
    "autotp_size": f"{_FEATURES}.tensor_parallel.autotp_size",
    "managed_gradient_accumulation": f"{_FEATURES}.managed_gradient_accumulation",
    "is_deepcompile_enabled": f"{_FEATURES}.compile.deepcompile",
}
