"""DeepSpeed 0.19 config parity: every documented key accepted, honoured or refused only when it
asks for a feature ds does not implement; "auto" placeholders; Infinity, base64 and HJSON
configs; the config as a mapping; the accessor table against DeepSpeed's defaults."""

from __future__ import annotations

import base64
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_engine import ConfigError, DeepSpeedConfig
from ds_engine._config_accessors import DEEPSPEED_ACCESSORS
from ds_engine._config_features import NOT_IMPLEMENTED
from ds_engine.api import load_config_dict

BASE = {"train_micro_batch_size_per_gpu": 2}

# Every top-level key DeepSpeed 0.19's config reads or documents, each at a value that asks for
# nothing beyond what ds implements.
EVERY_KEY: dict[str, Any] = {
    "train_batch_size": 4,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}, "legacy_fusion": False},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
    "fp16": {"enabled": False},
    "bf16": {"enabled": False},
    "zero_optimization": {"stage": 2},
    "comms_logger": {"enabled": False},
    "checkpoint": {"tag_validation": "Warn", "load_universal": False},
    "data_types": {"grad_accum_dtype": None, "buffer_dtype": None},
    "gradient_clipping": 1.0,
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
    "prescale_gradients": False,
    "gradient_predivide_factor": 1.0,
    "communication_data_type": None,
    "zero_allow_untested_optimizer": False,
    "zero_force_ds_cpu_optimizer": True,
    "memory_breakdown": False,
    "dataloader_drop_last": False,
    "dump_state": False,
    "log_level": "info",
    "aio": {"block_size": 1048576},
    "activation_checkpointing": {"partition_activations": False, "number_checkpoints": None},
    "flops_profiler": {"enabled": False, "profile_step": 5},
    "autotuning": {"enabled": False, "metric": "latency"},
    "tensorboard": {"enabled": False, "output_path": "runs"},
    "csv_monitor": {"enabled": False},
    "wandb": {"enabled": False, "project": "p"},
    "comet": {"enabled": False},
    "hybrid_engine": {"enabled": False},
    "torch_autocast": {"enabled": False, "dtype": "bfloat16"},
    "tensor_parallel": {"autotp_size": 1},
    "expert_parallel": {"enabled": False},
    "sequence_parallel_size": 1,
    "seq_parallel_communication_data_type": "fp32",
    "use_data_before_expert_parallelism": False,
    "gradient_allreduce_op": "MEAN",
    "managed_gradient_accumulation": True,
    "disable_allgather": False,
    "disable_python_gc": False,
    "vocabulary_size": None,
    "weight_quantization": {"post_init_quant": {"enabled": False}},
    "compile": {"deepcompile": False},
    "datastates_ckpt": {},
    "data_efficiency": {"enabled": False, "data_sampling": {"enabled": False}},
    "elasticity": {"enabled": False, "max_train_batch_size": 64},
    "curriculum_learning": {"enabled": False},
    "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": False}}},
    "progressive_layer_drop": {"enabled": False},
    "quantize_training": {"enabled": False},
    "eigenvalue": {"enabled": False},
    "nebula": {"enabled": False},
    "amp": {"enabled": False},
    "sparse_attention": {},
    "sparse_gradients": False,
    "graph_harvesting": False,
    "pipeline": {"stages": "auto", "partition": "best", "pipe_partitioned": False},
    "timers": {"throughput": {"enabled": True, "synchronized": True}},
    "seed": 1234,
}


def test_every_deepspeed_key_is_accepted_when_it_asks_for_nothing() -> None:
    assert "bfloat16" not in EVERY_KEY  # the alias is tested apart (one of bf16/bfloat16)
    cfg = DeepSpeedConfig.from_dict(EVERY_KEY, dp_world_size=2)
    assert set(NOT_IMPLEMENTED) <= set(EVERY_KEY)
    assert cfg.tensorboard.output_path == "runs" and not cfg.monitor_config.enabled
    assert cfg.unimplemented.autotuning.metric == "latency"
    assert cfg.flops_profiler.profile_step == 5
    assert cfg.flops_profiler.module_depth == -1  # DeepSpeed's default
    assert cfg.log_level == "info" and cfg.zero_force_ds_cpu_optimizer is True


@pytest.mark.parametrize(
    ("key", "value", "feature"),
    [
        ("tensor_parallel", {"autotp_size": 2, "tp_overlap_comm": True}, "AutoTP settings"),
        ("elasticity", {"enabled": True}, "elastic training"),
        (
            "compression_training",
            {"sparse_pruning": {"shared_parameters": {"enabled": True}}},
            "com",
        ),
        ("sparse_attention", {"mode": "fixed"}, "sparse attention"),
        ("gradient_allreduce_op", "sum", "summed"),
        ("managed_gradient_accumulation", False, "client-managed"),
        ("sparse_gradients", True, "sparse"),
        ("compile", {"deepcompile": True}, "DeepCompile"),
        ("pipeline", {"activation_checkpoint_interval": 2}, "pipeline"),
        ("hybrid_engine", {"enabled": True}, "hybrid"),
        ("torch_autocast", {"enabled": True}, "autocast"),
    ],
)
def test_a_key_asking_for_an_unimplemented_feature_is_refused(
    key: str, value, feature: str
) -> None:
    with pytest.raises(ConfigError) as err:
        DeepSpeedConfig.from_dict({**BASE, key: value})
    message = str(err.value)
    assert message.startswith(f"{key} = ")
    assert feature in message and "not implemented in ds" in message


@pytest.mark.parametrize(
    ("config", "suggestion"),
    [
        ({"tensorbaord": {"enabled": False}}, "tensorboard"),
        ({"tensorboard": {"enabeld": False}}, "enabled"),
        ({"flops_profiler": {"module_dept": 2}}, "module_depth"),
        ({"checkpoint": {"tag_validaton": "Warn"}}, "tag_validation"),
        ({"data_types": {"buffer_dtpye": "fp32"}}, "buffer_dtype"),
        ({"dataloader_drop_lst": True}, "dataloader_drop_last"),
        ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_sise": 1}}, "stage3_prefetch"),
    ],
)
def test_misspellings_get_did_you_mean_in_every_section(config: dict, suggestion: str) -> None:
    with pytest.raises(ConfigError, match=f"did you mean '{suggestion}"):
        DeepSpeedConfig.from_dict({**BASE, **config})


def test_activation_checkpointing_section_is_typed() -> None:
    section = {"partition_activations": True, "cpu_checkpointing": True, "number_checkpoints": 4}
    cfg = DeepSpeedConfig.from_dict({**BASE, "activation_checkpointing": section})
    assert cfg.activation_checkpointing.partition_activations
    assert cfg.activation_checkpointing.number_checkpoints == 4
    assert cfg["activation_checkpointing"] == section
    with pytest.raises(ConfigError, match="number_checkpoints = 0"):
        DeepSpeedConfig.from_dict({**BASE, "activation_checkpointing": {"number_checkpoints": 0}})
    with pytest.raises(ConfigError, match="did you mean 'cpu_checkpointing'"):
        DeepSpeedConfig.from_dict({**BASE, "activation_checkpointing": {"cpu_checkpoint": True}})


def test_bf16_and_its_alias_together_are_an_error() -> None:
    with pytest.raises(ConfigError, match="bfloat16 and bf16"):
        DeepSpeedConfig.from_dict({**BASE, "bf16": {"enabled": True}, "bfloat16": {}})


# --- "auto" -------------------------------------------------------------------------------------

# transformers' documented ZeRO-3 template, as zero.Init and initialize may see it unresolved.
HF_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}


def test_auto_placeholders_take_deepspeeds_defaults() -> None:
    cfg = DeepSpeedConfig.from_dict({**HF_ZERO3, "train_micro_batch_size_per_gpu": 4})
    zero = cfg.zero_optimization
    assert zero.stage3_param_persistence_threshold == 100_000
    assert zero.reduce_bucket_size == 500_000_000
    assert zero.stage3_prefetch_bucket_size == 50_000_000
    assert cfg.gradient_clipping == 1.0
    assert cfg.fp16.enabled is False and cfg.bf16.enabled is False
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (4, 1)
    assert cfg["train_batch_size"] == "auto"  # the mapping is the user's dict, unresolved


def test_unresolved_optimizer_params_are_an_error_when_the_optimizer_is_built() -> None:
    cfg = DeepSpeedConfig.from_dict({**HF_ZERO3, "train_micro_batch_size_per_gpu": 4})
    assert cfg.optimizer is not None and cfg.optimizer.params["lr"] == "auto"
    with pytest.raises(ConfigError, match=r"optimizer\.params\.lr.*= \"auto\".*transformers"):
        cfg.optimizer.resolved_params()
    assert cfg.scheduler is not None
    with pytest.raises(ConfigError, match=r"scheduler\.params\.warmup_min_lr"):
        cfg.scheduler.resolved_params()


def test_batch_keys_all_auto_say_that_auto_counts_as_missing() -> None:
    with pytest.raises(ConfigError, match='"auto" counts as missing'):
        DeepSpeedConfig.from_dict(HF_ZERO3)


# --- steps_per_print, base64, HJSON, duplicate keys ----------------------------------------------


def test_steps_per_print_infinity_means_never() -> None:
    cfg = DeepSpeedConfig.from_dict({**BASE, "steps_per_print": float("inf")})
    assert math.isinf(cfg.steps_per_print)
    assert all(step % cfg.steps_per_print != 0 for step in range(1, 1000))
    assert math.isinf(DeepSpeedConfig.from_dict({**BASE, "steps_per_print": None}).steps_per_print)
    parsed = load_config_dict(base64.urlsafe_b64encode(b'{"steps_per_print": Infinity}').decode())
    assert math.isinf(parsed["steps_per_print"])
    for bad in (0, -1, 2.5, float("nan"), "often"):
        with pytest.raises(ConfigError, match="steps_per_print"):
            DeepSpeedConfig.from_dict({**BASE, "steps_per_print": bad})


def test_base64_config_is_decoded() -> None:
    encoded = base64.urlsafe_b64encode(json.dumps({**BASE, "gradient_clipping": 0.5}).encode())
    cfg = DeepSpeedConfig.from_dict(load_config_dict(encoded.decode()))
    assert cfg.gradient_clipping == 0.5
    with pytest.raises(ConfigError, match="not a base64-encoded JSON object"):
        load_config_dict("bm90IGpzb24=")  # base64 of "not json"


def test_config_files_are_hjson(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(
        "{\n  // a comment\n  train_micro_batch_size_per_gpu: 2,\n"
        '  "zero_optimization": {"stage": 2,},  # trailing comma\n}\n'
    )
    loaded = load_config_dict(path)
    assert loaded == {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
    assert type(loaded["zero_optimization"]) is dict


def test_duplicate_keys_are_an_error(tmp_path: Path) -> None:
    path = tmp_path / "dup.json"
    path.write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 2}}')
    with pytest.raises(ConfigError, match="Duplicate keys in DeepSpeed config: 'stage'"):
        load_config_dict(path)
    encoded = base64.urlsafe_b64encode(b'{"fp16": {}, "fp16": {}}').decode()
    with pytest.raises(ConfigError, match="Duplicate keys"):
        load_config_dict(encoded)


def test_a_mapping_is_deep_copied() -> None:
    given = {**BASE, "zero_optimization": {"stage": 1}}
    loaded = load_config_dict(given)
    loaded["zero_optimization"]["stage"] = 3
    assert given["zero_optimization"]["stage"] == 1


# --- the config as DeepSpeed's engine.config (a dict) ----------------------------------------


def test_the_config_is_a_read_only_mapping_over_the_users_dict() -> None:
    user = {**BASE, "zero_optimization": {"stage": 2}, "bfloat16": {"enabled": True}}
    cfg = DeepSpeedConfig.from_dict(user)
    assert cfg.zero_optimization.stage == 2  # typed
    assert cfg.get("zero_optimization") == {"stage": 2}  # the user's dict
    assert cfg["bfloat16"] == {"enabled": True} and cfg.bf16.enabled
    assert "zero_optimization" in cfg and "fp16" not in cfg
    assert cfg.get("fp16", {}).get("enabled", False) is False  # what trainer.py does
    assert list(cfg) == list(user) and len(cfg) == len(user) and dict(cfg) == user
    with pytest.raises(KeyError):
        cfg["fp16"]
    with pytest.raises(TypeError):
        cfg["steps_per_print"] = 5  # type: ignore[index]
    user["zero_optimization"]["stage"] = 3  # the caller's dict is not aliased
    assert cfg["zero_optimization"] == {"stage": 2}


def test_a_directly_built_config_maps_its_batch_sizes() -> None:
    cfg = DeepSpeedConfig(
        train_batch_size=4, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2
    )
    assert dict(cfg) == {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
    }


# --- checkpoint and data_types --------------------------------------------------------------


def test_checkpoint_section() -> None:
    cfg = DeepSpeedConfig.from_dict(
        {**BASE, "checkpoint": {"tag_validation": "fail", "use_node_local_storage": True}}
    )
    assert cfg.checkpoint.tag_validation == "FAIL"
    assert cfg.checkpoint.tag_validation_enabled and cfg.checkpoint.tag_validation_fail
    assert cfg.checkpoint.use_node_local_storage
    ignore = DeepSpeedConfig.from_dict({**BASE, "checkpoint": {"tag_validation": "Ignore"}})
    assert not ignore.checkpoint.tag_validation_enabled
    for section, words in (
        ({"tag_validation": "loud"}, "Ignore, Warn or Fail"),
        ({"parallel_write": {"pipeline_stage": True}}, "not implemented in ds"),
        ({"writer": {"type": "fast"}}, "not implemented in ds"),
        ({"checkpoint_serialization": False}, "not implemented in ds"),
    ):
        with pytest.raises(ConfigError, match=words):
            DeepSpeedConfig.from_dict({**BASE, "checkpoint": section})


def test_data_types_section() -> None:
    cfg = DeepSpeedConfig.from_dict(
        {
            **BASE,
            "bf16": {"enabled": True},
            "data_types": {"param_dtype": "bf16", "buffer_dtype": "fp32"},
        }
    )
    assert cfg.data_types.buffer_torch_dtype is torch.float32
    assert cfg.data_types.param_torch_dtype is torch.bfloat16
    assert cfg.data_types.keep_in_fp32_modules == "auto"
    with pytest.raises(ConfigError, match="param_dtype = 'fp16' conflicts"):
        DeepSpeedConfig.from_dict(
            {**BASE, "bf16": {"enabled": True}, "data_types": {"param_dtype": "fp16"}}
        )
    with pytest.raises(ConfigError, match="keep_in_fp32_modules"):
        DeepSpeedConfig.from_dict({**BASE, "data_types": {"keep_in_fp32_modules": "all"}})


def _offload(stage: int) -> dict[str, Any]:
    return {"stage": stage, "offload_optimizer": {"device": "cpu"}}


@pytest.mark.parametrize(
    ("precision", "zero", "accum", "accepted"),
    [
        # The dtype ds accumulates in: the model's at stages 0-2, fp32 at stage 3 and at
        # stage 2 under optimizer offload (its fp32 host partition).
        (None, {"stage": 0}, "fp32", True),
        ("bf16", {"stage": 1}, "bf16", True),
        ("fp16", {"stage": 2}, "float16", True),
        ("bf16", {"stage": 3}, "fp32", True),
        ("bf16", _offload(2), "fp32", True),
        ("bf16", _offload(1), "bf16", True),
        ("bf16", {"stage": 0}, "fp32", False),
        ("bf16", {"stage": 2}, "fp32", False),
        ("bf16", {"stage": 3}, "bf16", False),
        ("bf16", _offload(2), "bf16", False),
        (None, {"stage": 1}, "bf16", False),
    ],
)
def test_grad_accum_dtype_is_what_ds_accumulates_in(
    precision: str | None, zero: dict[str, Any], accum: str, accepted: bool
) -> None:
    config = {**BASE, "zero_optimization": zero, "data_types": {"grad_accum_dtype": accum}}
    if precision is not None:
        config[precision] = {"enabled": True}
    if accepted:
        assert DeepSpeedConfig.from_dict(config).data_types.grad_accum_dtype == accum
        return
    with pytest.raises(ConfigError, match=r"grad_accum_dtype = .*not implemented in ds"):
        DeepSpeedConfig.from_dict(config)


def test_nvme_optimizer_offload_at_stage_3_is_accepted() -> None:
    # ZeRO-Infinity (trained in test_offload_nvme.py)
    section = {"device": "nvme", "nvme_path": "/tmp"}
    zero = {"stage": 3, "offload_optimizer": section, "offload_param": section}
    config = DeepSpeedConfig.from_dict({**BASE, "zero_optimization": zero})
    assert config.zero_optimization.offload_optimizer.device == "nvme"
    assert config.zero_optimization.offload_param.device == "nvme"


# --- accessors -------------------------------------------------------------------------------

# DeepSpeed 0.19.8's engine accessors on {"train_micro_batch_size_per_gpu": 2} (measured with
# DS_ACCELERATOR=cpu); sections are compared by their contents below.
DEEPSPEED_DEFAULTS: dict[str, Any] = {
    "train_batch_size": 2,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "wall_clock_breakdown": False,
    "memory_breakdown": False,
    "gradient_predivide_factor": 1.0,
    "postscale_gradients": True,
    "zero_allow_untested_optimizer": False,
    "zero_force_ds_cpu_optimizer": True,
    "dataloader_drop_last": False,
    "dump_state": False,
    "log_level": None,
    "fp16_enabled": False,
    "fp16_auto_cast": False,
    "loss_scale": 0.0,
    "dynamic_loss_scale": True,
    "initial_dynamic_scale": 65536,
    "fp16_master_weights_and_gradients": False,
    "bfloat16_enabled": False,
    "bf16_master_weights_and_gradients": False,
    "bf16_optimizer_states": False,
    "checkpoint_tag_validation_enabled": True,
    "checkpoint_tag_validation_fail": False,
    "load_universal_checkpoint": False,
    "use_node_local_storage": False,
    "checkpoint_serialization_enabled": True,
    "checkpoint_writer_enabled": False,
    "zero_optimization_stage": 0,
    "zero_optimization": False,
    "zero_optimization_partition_gradients": False,
    "zero_optimization_partition_weights": False,
    "zero_use_cpu_optimizer": False,
    "zero_contiguous_gradients": True,
    "zero_reduce_scatter": True,
    "zero_reduce_bucket_size": 500_000_000,
    "zero_multi_rank_bucket_allreduce": True,
    "zero_allgather_partitions": True,
    "zero_allgather_bucket_size": 500_000_000,
    "zero_overlap_comm": False,
    "zero_round_robin_gradients": False,
    "zero_offload_optimizer": None,
    "zero_offload_param": None,
    "zero_partial_offload": 1.0,
    "super_offload": False,
    "zero_elastic_checkpoint": False,
    "zero_load_from_fp32_weights": True,
    "zero_ignore_unused_parameters": True,
    "zero_sub_group_size": 1_000_000_000,
    "zero_prefetch_bucket_size": 50_000_000,
    "zero_param_persistence_threshold": 100_000,
    "zero_max_live_parameters": 1_000_000_000,
    "zero_max_reuse_distance": 1_000_000_000,
    "zero_gather_16bit_weights_on_model_save": False,
    "zero_model_persistence_threshold": 9223372036854775807,
    "zero_module_granularity_threshold": 0,
    "zero_allgather_sequential": False,
    "zero_hpz_partition_size": 1,
    "zero_quantized_weights": False,
    "zero_quantized_nontrainable_weights": False,
    "zero_quantized_gradients": False,
    "zero_legacy_stage1": False,
    "zero_log_trace_cache_warnings": False,
    "zero_parameter_alignment": False,
    "zero_compute_grad_norm": True,
    "zero_save_muon_momentum_buffer_in_memory": False,
    "zenflow_config": None,
    "is_sanity_checks_enabled": False,
    "flops_profiler_enabled": False,
    "flops_profiler_recompute_fwd_factor": 0.0,
    "flops_profiler_profile_step": 1,
    "flops_profiler_module_depth": -1,
    "flops_profiler_top_modules": 1,
    "flops_profiler_detailed": True,
    "flops_profiler_output_file": None,
    "autotuning_enabled": False,
    "autotuning_start_profile_step": 3,
    "autotuning_end_profile_step": 5,
    "autotuning_metric": "throughput",
    # legacy curriculum and PLD (DeepSpeed 0.18's accessors and defaults; 0.19 removed them)
    "curriculum_enabled_legacy": False,
    "pld_enabled": False,
    "pld_theta": 1.0,
    "pld_gamma": 0.001,
    "data_efficiency_enabled": False,
    "data_sampling_enabled": False,
    "curriculum_learning_enabled": False,
    "random_ltd_enabled": False,
    "torch_autocast_enabled": False,
    "torch_autocast_dtype": None,
    "torch_autocast_lower_precision_safe_modules": [
        "torch.nn.modules.linear.Linear",
        "torch.nn.modules.conv.Conv1d",
        "torch.nn.modules.conv.Conv2d",
        "torch.nn.modules.conv.Conv3d",
    ],
    "autotp_size": 0,
    "managed_gradient_accumulation": True,
    "is_deepcompile_enabled": False,
}
# Accessors that return a section (DeepSpeed: a dict or a model), with one key each must hold.
SECTION_ACCESSORS = {
    "aio_config": None,  # None here without ds-offload-aio's section; a dict in DeepSpeed
    "data_efficiency_config": ("seed", 1234),
    "data_sampling_config": ("num_epochs", 1000),
    "curriculum_learning_config": ("enabled", False),
    "random_ltd_config": ("enabled", False),
    "curriculum_params_legacy": None,  # {} without the section (DeepSpeed 0.18: False)
    "pld_params": ("theta", 1.0),
    "tensor_parallel_config": ("autotp_size", 0),
    "dynamic_loss_scale_args": ("init_scale", 65536),
    "cpuadam_cores_perc": None,  # 0.8 (the model's default; DeepSpeed says 0.9 with no section)
    "steps_per_print": None,  # 10, the documented default (DeepSpeed 0.19's code says None)
}


def _read(config: Any, path: str) -> Any:
    """What the engine's generated accessor reads: attributes first, then mapping keys."""
    value = config
    for part in path.split("."):
        value = getattr(value, part) if hasattr(value, part) else value[part]
    return value


def test_every_accessor_path_resolves_to_deepspeeds_default() -> None:
    cfg = DeepSpeedConfig.from_dict(BASE)
    assert set(DEEPSPEED_DEFAULTS) | set(SECTION_ACCESSORS) == set(DEEPSPEED_ACCESSORS)
    for name, expected in DEEPSPEED_DEFAULTS.items():
        got = _read(cfg, DEEPSPEED_ACCESSORS[name])
        assert got == expected and type(got) is type(expected), name
    for name, key_value in SECTION_ACCESSORS.items():
        got = _read(cfg, DEEPSPEED_ACCESSORS[name])
        if key_value is not None:
            key, value = key_value
            assert got[key] == value, name


def test_accessors_follow_the_config() -> None:
    cfg = DeepSpeedConfig.from_dict(
        {
            **BASE,
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}},
            "flops_profiler": {"enabled": False, "top_modules": 7},
        }
    )
    assert _read(cfg, DEEPSPEED_ACCESSORS["zero_offload_param"]).device == "cpu"
    assert _read(cfg, DEEPSPEED_ACCESSORS["zero_overlap_comm"]) is True
    assert _read(cfg, DEEPSPEED_ACCESSORS["flops_profiler_top_modules"]) == 7


def test_the_schema_lists_every_accepted_key() -> None:
    from ds_engine import config_json_schema

    props = config_json_schema()["properties"]
    assert set(EVERY_KEY) | {"bfloat16"} <= set(props)
    checkpoint = props["checkpoint"]["properties"]
    assert checkpoint["parallel_write"] == {} and checkpoint["tag_validation"]["type"] == "string"
    assert props["data_types"]["properties"]["keep_in_fp32_modules"] == {}  # "auto" or a list
    assert set(props["flops_profiler"]["properties"]) == {
        "enabled",
        "recompute_fwd_factor",
        "profile_step",
        "module_depth",
        "top_modules",
        "detailed",
        "output_file",
    }
