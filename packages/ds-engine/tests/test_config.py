"""The composed config: batch-size triad, unknown keys, DeepSpeed defaults, legacy forms, schema,
and where initialize() reads the config from."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

import ds_engine
from ds_engine import ConfigError, DeepSpeedConfig, config_json_schema
from ds_engine._initialize import _config_source


@pytest.mark.parametrize(
    ("given", "world", "triad"),
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 2, (32, 4, 4)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (32, 4, 2)),
        ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 5}, 2, (30, 3, 5)),
        ({"train_batch_size": 12}, 3, (12, 4, 1)),
        ({"train_micro_batch_size_per_gpu": 6}, 4, (24, 6, 1)),
        (
            {
                "train_batch_size": 16,
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 4,
            },
            2,
            (16, 2, 4),
        ),
    ],
)
def test_any_two_of_the_triad_give_the_third(given: dict, world: int, triad: tuple) -> None:
    cfg = DeepSpeedConfig.from_dict(given, dp_world_size=world)
    got = (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    )
    assert got == triad


def test_inconsistent_triad_prints_the_equation_with_numbers() -> None:
    given = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
    }
    with pytest.raises(ConfigError) as err:
        DeepSpeedConfig.from_dict(given, dp_world_size=2)
    message = str(err.value)
    for piece in ("train_batch_size (32)", "(4)", "(2)", "data-parallel size (2)", "= 16"):
        assert piece in message


def test_indivisible_and_missing_batch_sizes_are_errors() -> None:
    with pytest.raises(ConfigError, match="not divisible"):
        DeepSpeedConfig.from_dict({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3})
    with pytest.raises(ConfigError, match="both missing"):
        DeepSpeedConfig.from_dict({"gradient_accumulation_steps": 2})
    with pytest.raises(ConfigError, match="train_batch_size = 0"):
        DeepSpeedConfig.from_dict({"train_batch_size": 0})


@pytest.mark.parametrize(
    ("config", "suggestion"),
    [
        ({"train_batch_size": 8, "gradient_cliping": 1.0}, "gradient_clipping"),
        ({"train_batch_size": 8, "steps_per_prnt": 5}, "steps_per_print"),
        ({"train_batch_size": 8, "zero_optimization": {"stgae": 2}}, "stage"),
        ({"train_batch_size": 8, "fp16": {"enabeld": True}}, "enabled"),
        ({"train_batch_size": 8, "comms_logger": {"verbos": True}}, "verbose"),
    ],
)
def test_misspelled_keys_are_errors_with_a_suggestion(config: dict, suggestion: str) -> None:
    with pytest.raises(ConfigError, match=f"did you mean '{suggestion}'"):
        DeepSpeedConfig.from_dict(config)


def test_bad_values_name_the_key_and_the_value() -> None:
    with pytest.raises(ConfigError, match=r"gradient_clipping = -1"):
        DeepSpeedConfig.from_dict({"train_batch_size": 8, "gradient_clipping": -1})
    with pytest.raises(ConfigError, match=r"wall_clock_breakdown = 'yes'"):
        DeepSpeedConfig.from_dict({"train_batch_size": 8, "wall_clock_breakdown": "yes"})
    with pytest.raises(ConfigError, match=r"zero_optimization.stage = 5"):
        DeepSpeedConfig.from_dict({"train_batch_size": 8, "zero_optimization": {"stage": 5}})
    with pytest.raises(ConfigError, match="choose one"):
        DeepSpeedConfig.from_dict(
            {"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}}
        )


def test_reduction_keys_are_accepted_and_validated() -> None:
    cfg = DeepSpeedConfig.from_dict(
        {
            "train_batch_size": 8,
            "prescale_gradients": True,
            "gradient_predivide_factor": 4,
            "communication_data_type": "bf16",
        }
    )
    assert cfg.prescale_gradients is True
    assert cfg.gradient_predivide_factor == 4.0
    assert cfg.communication_data_type == "bf16"
    with pytest.raises(ConfigError, match=r"gradient_predivide_factor = 0"):
        DeepSpeedConfig.from_dict({"train_batch_size": 8, "gradient_predivide_factor": 0})
    with pytest.raises(ConfigError, match=r"gradient_predivide_factor = -2"):
        DeepSpeedConfig.from_dict({"train_batch_size": 8, "gradient_predivide_factor": -2})
    with pytest.raises(ConfigError, match=r"communication_data_type = 'fp8'"):
        DeepSpeedConfig.from_dict({"train_batch_size": 8, "communication_data_type": "fp8"})


def test_defaults_follow_deepspeed() -> None:
    cfg = DeepSpeedConfig.from_dict({"train_batch_size": 8})
    assert cfg.gradient_clipping == 1.0
    assert cfg.steps_per_print == 10
    assert cfg.gradient_accumulation_steps == 1
    assert cfg.wall_clock_breakdown is False
    assert cfg.prescale_gradients is False
    assert cfg.gradient_predivide_factor == 1.0
    assert cfg.communication_data_type is None
    assert cfg.zero_optimization.stage == 0
    assert cfg.fp16.enabled is False and cfg.bf16.enabled is False
    assert cfg.optimizer is None and cfg.scheduler is None
    assert cfg.param_dtype_name == "fp32"


def test_sections_are_parsed_by_their_owning_packages() -> None:
    import ds_comm
    import ds_optim
    import ds_zero

    cfg = DeepSpeedConfig.from_dict(
        {
            "train_batch_size": 8,
            "optimizer": {"type": "adamw", "params": {"lr": 1e-3}},
            "scheduler": {"type": "warmuplr", "params": {"warmup_num_steps": 10}},
            "bfloat16": {"enabled": True},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
            "comms_logger": {"enabled": True},
        }
    )
    assert isinstance(cfg.optimizer, ds_optim.OptimizerConfig) and cfg.optimizer.type == "AdamW"
    assert isinstance(cfg.scheduler, ds_optim.SchedulerConfig)
    assert cfg.bf16.enabled and cfg.param_dtype_name == "bf16"
    assert isinstance(cfg.zero_optimization, ds_zero.ZeroConfig)
    assert cfg.zero_optimization.offload_optimizer.device == "cpu"
    assert isinstance(cfg.comms_logger, ds_comm.CommsLoggerConfig)


def test_legacy_boolean_zero_optimization_means_stage_1() -> None:
    on = DeepSpeedConfig.from_dict({"train_batch_size": 8, "zero_optimization": True})
    off = DeepSpeedConfig.from_dict({"train_batch_size": 8, "zero_optimization": False})
    assert on.zero_optimization.stage == 1
    assert off.zero_optimization.stage == 0


def test_json_schema_covers_every_section_and_serialises() -> None:
    schema = config_json_schema()
    props = schema["properties"]
    for key in ("train_batch_size", "gradient_clipping", "fp16", "bf16", "zero_optimization"):
        assert key in props
    assert props["gradient_clipping"]["default"] == 1.0
    assert props["steps_per_print"]["type"] == ["integer", "number"]  # Infinity: never print
    assert "tensorboard" in props and "checkpoint" in props and "data_types" in props
    assert props["fp16"]["properties"]["initial_scale_power"]["default"] == 16
    zero = props["zero_optimization"]["anyOf"][0]["properties"]
    assert zero["offload_optimizer"]["properties"]["device"]["default"] == "none"
    assert schema["additionalProperties"] is False
    assert json.loads(json.dumps(schema)) == schema


def test_config_comes_from_exactly_one_source(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8}))
    args = argparse.Namespace(deepspeed_config=str(path))
    assert _config_source(args, None, None) == str(path)
    assert _config_source(None, {"a": 1}, None) == {"a": 1}
    with pytest.raises(ConfigError, match="given 2 times"):
        _config_source(args, {"train_batch_size": 8}, None)
    with pytest.raises(ConfigError, match="no config"):
        _config_source(None, None, None)


def test_config_file_errors_name_the_file(tmp_path: Path) -> None:
    from ds_engine.api import load_config_dict

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config_dict(bad)
    with pytest.raises(ConfigError, match="no such JSON file"):
        load_config_dict(tmp_path / "missing.json")
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"train_batch_size": 4}))
    assert load_config_dict(good) == {"train_batch_size": 4}


def test_add_config_arguments_adds_deepspeeds_flags() -> None:
    parser = ds_engine.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--deepspeed", "--deepspeed_config", "c.json", "--deepspeed_mpi", "--local_rank", "3"]
    )
    assert args.deepspeed and args.deepspeed_mpi
    assert args.deepspeed_config == "c.json" and args.local_rank == 3
    plain = ds_engine.add_config_arguments(argparse.ArgumentParser()).parse_args([])
    assert plain.deepspeed is False and plain.deepspeed_config is None and plain.local_rank == -1
