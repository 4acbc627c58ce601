"""``import ds_engine as deepspeed``: the deepspeed.* submodules are real, importable re-exports."""

from __future__ import annotations

import pytest

import ds_comm
import ds_optim


def test_deepspeed_submodules_import_as_in_deepspeed() -> None:
    import ds_engine as deepspeed
    import ds_engine.comm as dist
    from ds_engine.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from ds_engine.ops.lamb import FusedLamb
    from ds_engine.runtime.lr_schedules import OneCycle, WarmupLR

    assert dist.all_reduce is ds_comm.all_reduce and dist.get_rank is ds_comm.get_rank
    assert deepspeed.comm is dist
    assert deepspeed.init_distributed is ds_comm.init_distributed
    assert DeepSpeedCPUAdam is ds_optim.CPUAdam and FusedAdam is ds_optim.FusedAdam
    assert FusedLamb is ds_optim.FusedLamb
    assert WarmupLR is ds_optim.WarmupLR and OneCycle is ds_optim.OneCycle
    assert deepspeed.ops.adam.FusedAdam is FusedAdam
    assert deepspeed.runtime.lr_schedules.WarmupLR is WarmupLR


def test_moe_layer_is_ds_moe() -> None:
    import ds_engine as deepspeed
    import ds_moe
    from ds_engine.moe.layer import MoE

    assert MoE is ds_moe.MoE
    assert deepspeed.moe.layer.MoE is MoE


def test_zero_stage3_names_are_ds_zero() -> None:
    import ds_engine as deepspeed
    import ds_zero
    from ds_engine.zero import GatheredParameters, Init, register_external_parameter

    assert Init is ds_zero.Init
    assert GatheredParameters is ds_zero.GatheredParameters
    assert register_external_parameter is ds_zero.register_external_parameter
    assert deepspeed.zero.Init is Init


def test_missing_optional_package_names_the_pip_command() -> None:
    from ds_engine._optional import require

    with pytest.raises(ImportError, match="pip install ds-nothing"):
        require("ds_nothing_here", "ds-nothing", "deepspeed.nothing")
    assert require("ds_comm", "ds-comm", "deepspeed.comm") is ds_comm


def test_unknown_attribute_is_an_attribute_error() -> None:
    import ds_engine

    with pytest.raises(AttributeError, match="no_such_thing"):
        _ = ds_engine.no_such_thing


def test_accelerator_submodules_are_ds_comms_accelerator() -> None:
    import importlib

    import ds_comm.accelerator as accelerator

    for name in ("real_accelerator", "abstract_accelerator", "cpu_accelerator", "cuda_accelerator"):
        module = importlib.import_module(f"ds_engine.accelerator.{name}")
        assert module.get_accelerator is accelerator.get_accelerator
    from ds_engine.accelerator.cuda_accelerator import CUDA_Accelerator
    from ds_engine.accelerator.real_accelerator import get_accelerator

    assert CUDA_Accelerator is accelerator.CUDA_Accelerator
    assert get_accelerator() is accelerator.get_accelerator()
