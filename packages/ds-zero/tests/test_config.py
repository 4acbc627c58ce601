"""The ``zero_optimization`` section: DeepSpeed's defaults, stage flags, clear errors."""

from __future__ import annotations

import dataclasses

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
    assert (offload.pin_memory, offload.fast_init, offload.ratio) == (False, False, 1.0)
    assert not offload.enabled


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
    ("key", "value"), [("zero_quantized_gradients", True), ("mics_shard_size", 8)]
)
def test_zeropp_and_mics_keys_are_rejected_unless_at_their_default(key: str, value) -> None:
    with pytest.raises(ConfigError, match=f"{key}.*not supported yet.*default"):
        ZeroConfig.from_dict({"stage": 2, key: value})


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


def test_deprecated_keys_name_their_replacement() -> None:
    with pytest.raises(ConfigError, match=r"cpu_offload is deprecated.*offload_optimizer"):
        ZeroConfig.from_dict({"stage": 2, "cpu_offload": True})
    assert ZeroConfig.from_dict({"stage": 2, "cpu_offload": False}).stage == 2


def test_direct_construction_validates_too() -> None:
    with pytest.raises(ConfigError, match="overlap_comm"):
        ZeroConfig(overlap_comm="no")  # type: ignore[arg-type]
    config = ZeroConfig(stage=1, offload_optimizer={"device": "cpu"})  # type: ignore[arg-type]
    assert config.offload_optimizer.enabled
