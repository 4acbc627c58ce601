"""The ``zero_optimization`` section: DeepSpeed's defaults, stage flags, clear errors."""

from __future__ import annotations

import dataclasses
import re
import sys

import pytest

from ds_zero import ConfigError, OffloadOptimizerConfig, ZeroConfig


def test_defaults_are_deepspeeds() -> None:
    config = ZeroConfig.from_dict({})
    assert config == ZeroConfig()
    assert config.stage == 0
    assert config.contiguous_gradients is True
    assert config.reduce_scatter is True
    assert config.reduce_bucket_size == 500_000_000
    assert config.allgather_partitions is True
    assert config.allgather_bucket_size == 500_000_000
    assert config.overlap_comm is False  # DeepSpeed: True only for stage 3
    assert config.round_robin_gradients is False
    assert config.elastic_checkpoint is False
    assert config.load_from_fp32_weights is True
    assert config.ignore_unused_parameters is True
    offload = config.offload_optimizer
    assert (offload.device, offload.nvme_path, offload.buffer_count) == ("none", None, 4)
    assert (offload.pin_memory, offload.fast_init, offload.ratio) == (True, False, 1.0)
    assert not offload.enabled
    assert config.offload_param.pin_memory is True  # DeepSpeed pins offloaded memory by default
    assert config.zero_hpz_partition_size == 1 and not config.zero_quantized_weights
    assert not config.zero_quantized_gradients
    assert config.mics_shard_size == -1
    assert config.unimplemented["mics_hierarchical_params_gather"] is False
    assert config.unimplemented["compute_grad_norm"] is True


@pytest.mark.parametrize(
    ("stage", "shard_state", "shard_grads"), [(0, False, False), (1, True, False), (2, True, True)]
)
def test_stage_is_a_pair_of_flags(stage: int, shard_state: bool, shard_grads: bool) -> None:
    config = ZeroConfig.from_dict({"stage": stage})
    assert (config.shard_optimizer_state, config.shard_gradients) == (shard_state, shard_grads)


def test_a_deepspeed_stage_2_section_parses() -> None:
    section = {
        "stage": 2,
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
        "round_robin_gradients": True,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        # stage 3 keys at their defaults, as configs copied between stages carry them
        "sub_group_size": 1e9,
        "stage3_max_live_parameters": 1e9,
        "stage3_gather_16bit_weights_on_model_save": False,
    }
    config = ZeroConfig.from_dict(section)
    assert config.reduce_bucket_size == 200_000_000
    assert isinstance(config.reduce_bucket_size, int)
    assert config.overlap_comm is True
    assert config.offload_optimizer == OffloadOptimizerConfig(device="cpu", pin_memory=True)


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ZeroConfig().stage = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("section", "names"),
    [
        ({"overlap_com": True}, ["overlap_com", "overlap_comm"]),
        ({"offload_optimizer": {"devise": "cpu"}}, ["offload_optimizer.devise", "device"]),
        ({"stage": 4}, ["stage", "4"]),
        ({"stage": True}, ["stage", "True"]),
        ({"reduce_bucket_size": 0}, ["reduce_bucket_size", ">= 1"]),
        ({"reduce_bucket_size": 1.5}, ["reduce_bucket_size", "1.5"]),
        ({"allgather_bucket_size": "big"}, ["allgather_bucket_size", "'big'"]),
        ({"contiguous_gradients": "yes"}, ["contiguous_gradients", "true or false"]),
        ({"offload_optimizer": {"device": "gpu"}}, ["device", "'gpu'", "nvme"]),
        ({"offload_optimizer": {"device": "nvme"}}, ["nvme_path", "directory"]),
        ({"offload_optimizer": {"device": "cpu", "ratio": 0.5}}, ["ratio", "stage 3"]),
        ({"offload_optimizer": {"buffer_count": -1}}, ["buffer_count", ">= 0"]),
        ({"offload_optimizer": "cpu"}, ["offload_optimizer", "mapping"]),
        ({"offload_optimizer": {"device": "cpu"}}, ["stage 1 or 2"]),
    ],
)
def test_bad_sections_name_the_key_and_the_fix(section: dict, names: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        ZeroConfig.from_dict(section)
    for name in names:
        assert name in str(info.value)


def test_stage_3_parses() -> None:
    config = ZeroConfig.from_dict({"stage": 3})
    assert config.stage == 3 and config.shard_gradients and config.overlap_comm


@pytest.mark.parametrize(
    ("key", "value", "feature"),
    [
        ("zero_quantized_nontrainable_weights", True, "ZeRO++ quantized frozen weights"),
        ("mics_hierarchical_params_gather", True, "MiCS hierarchical gathers"),
        ("stage3_model_persistence_threshold", 10, "persistence budget"),
        ("zenflow", {"topk_ratio": 0.1}, "ZenFlow"),
        ("compute_grad_norm", False, "gradient norm"),
        ("stage3_allgather_sequential", True, "sequential"),
    ],
)
def test_unimplemented_keys_are_refused_only_when_requested(key: str, value, feature: str) -> None:
    with pytest.raises(
        ConfigError, match=f"{key}.*asks for.*{re.escape(feature)}.*not implemented in ds"
    ):
        ZeroConfig.from_dict({"stage": 2, key: value})


def test_every_deepspeed_zero_key_at_its_default_is_accepted() -> None:
    """DeepSpeed 0.19's DeepSpeedZeroConfig keys (and aliases), each at its default."""
    section = {
        "stage": 3,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 5e8,
        "use_multi_rank_bucket_allreduce": True,
        "allgather_partitions": True,
        "allgather_bucket_size": 5e8,
        "overlap_comm": True,
        "compute_grad_norm": True,
        "load_from_fp32_weights": True,
        "elastic_checkpoint": False,
        "offload_param": None,
        "offload_optimizer": None,
        "zenflow": None,
        "sub_group_size": 1e9,
        "stage3_prefetch_bucket_size": 5e7,
        "stage3_param_persistence_threshold": 1e5,
        "stage3_model_persistence_threshold": sys.maxsize,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": False,
        "stage3_module_granularity_threshold": 0,
        "stage3_use_all_reduce_for_fetch_params": False,
        "stage3_allgather_sequential": False,
        "ignore_unused_parameters": True,
        "legacy_stage1": False,
        "round_robin_gradients": False,
        "parameter_alignment": False,
        "zero_hpz_partition_size": 1,
        "zero_quantized_weights": False,
        "zero_quantized_nontrainable_weights": False,
        "zero_quantized_gradients": False,
        "memory_efficient_linear": True,
        "pipeline_loading_checkpoint": False,
        "override_module_apply": True,
        "log_trace_cache_warnings": False,
        "enable_sanity_checks": False,
        "save_muon_momentum_buffer_in_memory": False,
        "leaf_module": None,
        "mics_shard_size": -1,
        "mics_hierarchical_params_gather": False,
        "zeropp_loco_param": None,
    }
    config = ZeroConfig.from_dict(section)
    assert config.stage == 3 and config.stage3_param_persistence_threshold == 100_000
    offload = {
        "device": "cpu",
        "nvme_path": None,
        "buffer_count": 4,
        "pin_memory": True,
        "pipeline_read": False,
        "pipeline_write": False,
        "fast_init": False,
        "ratio": 1.0,
        "super_offload": False,
        "cpuadam_cores_perc": 0.8,
    }
    assert ZeroConfig.from_dict(
        {"stage": 2, "offload_optimizer": offload}
    ).offload_optimizer.enabled
    with pytest.raises(ConfigError, match="super_offload = true asks for SuperOffload"):
        ZeroConfig.from_dict({"stage": 2, "offload_optimizer": {**offload, "super_offload": True}})


def test_auto_is_deepspeeds_default() -> None:
    """Hugging Face writes "auto" and resolves it later; DeepSpeed's models drop it."""
    section = {
        "stage": 3,
        "overlap_comm": "auto",
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": "auto",
        "stage3_max_reuse_distance": "auto",
        "stage3_gather_16bit_weights_on_model_save": "auto",
        "sub_group_size": "auto",
        "offload_optimizer": {"device": "cpu", "pin_memory": "auto"},
        "zero_hpz_partition_size": "auto",
    }
    config = ZeroConfig.from_dict(section)
    assert config == ZeroConfig(stage=3, offload_optimizer=OffloadOptimizerConfig(device="cpu"))
    assert config.stage3_param_persistence_threshold == 100_000
    assert config.reduce_bucket_size == 500_000_000
    assert config.stage3_prefetch_bucket_size == 50_000_000
    assert config.overlap_comm is True


def test_misspelled_keys_in_offload_and_aliases_get_a_suggestion() -> None:
    with pytest.raises(ConfigError, match="did you mean 'stage3_param_persistence_threshold'"):
        ZeroConfig.from_dict({"stage": 3, "stage3_param_persistance_threshold": 10})
    with pytest.raises(ConfigError, match="did you mean 'pin_memory'"):
        ZeroConfig.from_dict({"stage": 3, "offload_param": {"pin_memroy": True}})


def test_offload_param_needs_stage_3() -> None:
    with pytest.raises(ConfigError, match=r"offload_param.*ZeRO stage 3"):
        ZeroConfig.from_dict({"stage": 2, "offload_param": {"device": "cpu"}})


def test_offload_param_off_is_accepted() -> None:
    for value in (None, {"device": "none"}):
        assert ZeroConfig.from_dict({"stage": 1, "offload_param": value}).stage == 1


@pytest.mark.parametrize("key", ["offload_optimizer", "offload_param"])
def test_offload_section_that_is_not_a_mapping_names_the_key(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"zero_optimization\.{key} = 'cpu'.*mapping"):
        ZeroConfig.from_dict({"stage": 3, key: "cpu"})


def test_deprecated_keys_are_translated_as_deepspeed_does() -> None:
    on = ZeroConfig.from_dict({"stage": 2, "cpu_offload": True})
    assert on.offload_optimizer.device == "cpu"
    assert (
        ZeroConfig.from_dict({"stage": 2, "cpu_offload": False}).offload_optimizer.device == "none"
    )
    three = ZeroConfig.from_dict({"stage": 3, "cpu_offload_param": True})
    assert three.offload_param.device == "cpu"
    with pytest.raises(ConfigError, match=r"cpu_offload = true.*offload_optimizer.device"):
        ZeroConfig.from_dict(
            {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "none"}}
        )
    with pytest.raises(ConfigError, match="cpu_offload = 'yes'"):
        ZeroConfig.from_dict({"stage": 2, "cpu_offload": "yes"})


def test_direct_construction_validates_too() -> None:
    with pytest.raises(ConfigError, match="overlap_comm"):
        ZeroConfig(overlap_comm="no")  # type: ignore[arg-type]
    config = ZeroConfig(stage=1, offload_optimizer={"device": "cpu"})  # type: ignore[arg-type]
    assert config.offload_optimizer.enabled
