"""``deepspeed.runtime.*``, ``deepspeed.zero``, ``deepspeed.pipe``, ``deepspeed.checkpoint`` and
``deepspeed.profiling`` in the ds_engine namespace: the owner packages' objects, and helpers with
DeepSpeed's semantics."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from collections import namedtuple
from typing import Any

import pytest
import torch

import ds_comm
import ds_optim
import ds_pipe
import ds_zero


def test_runtime_zero_is_ds_zero() -> None:
    from ds_engine.runtime import zero
    from ds_engine.runtime.zero import config, offload_config, stage3, stage_1_and_2

    for name in ("Init", "GatheredParameters", "ZeroParamStatus", "register_external_parameter"):
        assert getattr(zero, name) is getattr(ds_zero, name)
    assert stage3.DeepSpeedZeroOptimizer_Stage3 is ds_zero.Stage3Optimizer
    assert stage_1_and_2.DeepSpeedZeroOptimizer is ds_zero.ZeroOptimizer
    assert (
        stage3.estimate_zero3_model_states_mem_needs_all_live
        is ds_zero.estimate_zero3_model_states_mem_needs_all_live
    )
    assert config.DeepSpeedZeroConfig is ds_zero.ZeroConfig
    assert config.ZeroStageEnum.weights == 3 and config.ZeroStageEnum.disabled == 0
    assert offload_config.DeepSpeedZeroOffloadParamConfig is ds_zero.OffloadParamConfig
    assert offload_config.DeepSpeedZeroOffloadOptimizerConfig is ds_zero.OffloadOptimizerConfig
    assert offload_config.OffloadDeviceEnum("nvme") == "nvme"


def test_zero_is_runtime_zero() -> None:
    import ds_engine
    from ds_engine.runtime.zero import partition_parameters

    assert ds_engine.zero.Init is ds_engine.runtime.zero.Init
    assert ds_engine.zero.partition_parameters is partition_parameters
    assert ds_engine.zero.stage3 is ds_engine.runtime.zero.stage3


def test_fp_tensor_constructor_wrapper_has_deepspeeds_semantics() -> None:
    from ds_engine.runtime.zero import partition_parameters as pp

    assert pp._orig_torch_arange is torch.arange and pp._orig_torch_zeros is torch.zeros
    zeros = pp.zero_wrapper_for_fp_tensor_constructor(pp._orig_torch_zeros, torch.bfloat16, "cpu")
    assert zeros(2, 3).dtype == torch.bfloat16 and zeros(2, 3).shape == (2, 3)
    assert zeros(2, dtype=torch.int64).dtype == torch.int64  # integers are not cast
    arange = pp.zero_wrapper_for_fp_tensor_constructor(
        pp._orig_torch_arange, torch.float16, torch.device("cpu")
    )
    assert arange(0, 4, dtype=torch.float32).dtype == torch.float16
    assert arange(4).dtype == torch.int64
    assert arange(4, device="meta").device.type == "meta"  # an explicit device wins
    assert zeros(1).device.type == "cpu"


def test_wrapper_default_device_is_the_accelerators() -> None:
    from ds_engine.accelerator import get_accelerator
    from ds_engine.runtime.zero import partition_parameters as pp

    ones = pp.zero_wrapper_for_fp_tensor_constructor(pp._orig_torch_ones, torch.float64)
    assert ones(2).device == torch.device(get_accelerator().current_device_name())
    assert pp.get_accelerator is get_accelerator


def test_transformers_prevent_arange_dtype_change_pattern() -> None:
    # What transformers' prevent_arange_dtype_change does: swap the wrapper, keep arange's dtype.
    from ds_engine.runtime.zero import partition_parameters as pp

    original = pp.zero_wrapper_for_fp_tensor_constructor

    def without_arange(fn: Any, *args: Any, **kwargs: Any) -> Any:
        if fn is pp._orig_torch_arange:
            return fn
        return original(fn, *args, **kwargs)

    try:
        pp.zero_wrapper_for_fp_tensor_constructor = without_arange
        arange = pp.zero_wrapper_for_fp_tensor_constructor(pp._orig_torch_arange, torch.bfloat16)
        assert arange(0, 4, dtype=torch.float32).dtype == torch.float32
        zeros = pp.zero_wrapper_for_fp_tensor_constructor(pp._orig_torch_zeros, torch.bfloat16)
        assert zeros(2, device="cpu").dtype == torch.bfloat16
    finally:
        pp.zero_wrapper_for_fp_tensor_constructor = original


def test_runtime_pipe_is_ds_pipe_and_ds_comm() -> None:
    from ds_engine.runtime.pipe import module, schedule, topology

    assert module.PipelineModule is ds_pipe.PipelineModule
    assert module.LayerSpec is ds_pipe.LayerSpec and module.TiedLayerSpec is ds_pipe.TiedLayerSpec
    assert module.partition_balanced is ds_pipe.partition_balanced
    assert topology.ProcessTopology is ds_comm.ProcessTopology
    assert topology.PipeModelDataParallelTopology is ds_comm.PipeModelDataParallelTopology
    assert schedule.TrainSchedule is ds_pipe.TrainSchedule
    assert schedule.ForwardPass is ds_pipe.ForwardPass


def test_lr_schedules_valid_names() -> None:
    from ds_engine.runtime.lr_schedules import VALID_LR_SCHEDULES

    assert VALID_LR_SCHEDULES == [
        "LRRangeTest",
        "OneCycle",
        "WarmupLR",
        "WarmupDecayLR",
        "WarmupCosineLR",
    ]
    for name in VALID_LR_SCHEDULES:
        assert isinstance(getattr(ds_optim, name), type)


def test_config_engine_and_base_optimizer() -> None:
    import ds_engine
    from ds_engine.runtime import base_optimizer, config, dataloader, engine
    from ds_engine.runtime.fp16 import loss_scaler

    assert config.DeepSpeedConfig is ds_engine.DeepSpeedConfig
    assert config.DeepSpeedConfigError is ds_engine.ConfigError
    assert engine.DeepSpeedEngine is ds_engine.DeepSpeedEngine
    assert dataloader.DeepSpeedDataLoader is ds_engine.DeepSpeedDataLoader
    assert issubclass(ds_zero.ZeroOptimizer, base_optimizer.DeepSpeedOptimizer)
    assert issubclass(ds_zero.Stage3Optimizer, base_optimizer.ZeROOptimizer)
    assert not issubclass(torch.optim.SGD, base_optimizer.DeepSpeedOptimizer)
    assert loss_scaler.DynamicLossScaler is ds_optim.DynamicLossScaler
    assert loss_scaler.LossScaler is ds_optim.StaticLossScaler


def test_move_to_device_walks_containers() -> None:
    from ds_engine.runtime.utils import move_to_device

    pair = namedtuple("pair", "a b")
    item = {"x": torch.ones(2), "y": [torch.zeros(1, dtype=torch.int64), 3], "z": pair(1, "s")}
    moved = move_to_device(item, "meta")
    assert moved["x"].device.type == "meta" and moved["y"][0].device.type == "meta"
    assert moved["y"][1] == 3 and moved["z"] == pair(1, "s")
    floats_only = move_to_device(item, "meta", criterion_func=torch.is_floating_point)
    assert floats_only["x"].device.type == "meta"
    assert floats_only["y"][0] is item["y"][0]


def test_clip_grad_norm_matches_torch() -> None:
    from ds_engine.runtime.utils import clip_grad_norm_, get_global_norm

    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for p, q in zip(ours, ref):
        p.grad = torch.randn_like(p) * 10
        q.grad = p.grad.clone()
    norm = clip_grad_norm_(ours, max_norm=1.0)
    expected = torch.nn.utils.clip_grad_norm_(ref, max_norm=1.0)
    torch.testing.assert_close(norm, expected)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p.grad, q.grad)
    assert get_global_norm([3.0, 4.0]) == pytest.approx(5.0)


def test_see_memory_usage_is_silent_unless_forced(capsys: pytest.CaptureFixture[str]) -> None:
    from ds_engine.runtime.utils import ensure_directory_exists, see_memory_usage

    see_memory_usage("before", force=False)
    assert capsys.readouterr().out == ""
    ensure_directory_exists("relative-name-only")  # no directory part: nothing to create


def test_clone_tensors_for_torch_save_owns_its_storage() -> None:
    from ds_engine.checkpoint.utils import clone_tensors_for_torch_save

    flat = torch.arange(1000, dtype=torch.float32)
    view = flat[10:20]
    cloned = clone_tensors_for_torch_save({"w": view, "rest": [view, 1], "t": (view,)})
    assert torch.equal(cloned["w"], view)
    assert cloned["w"].untyped_storage().nbytes() == 10 * 4
    assert cloned["w"].data_ptr() != view.data_ptr()
    assert cloned["rest"][1] == 1 and isinstance(cloned["t"], tuple)
    assert clone_tensors_for_torch_save(view, device="meta").device.type == "meta"


def test_refused_names_import_and_say_not_implemented() -> None:
    from ds_engine.checkpoint import DeepSpeedCheckpoint

    with pytest.raises(NotImplementedError, match="universal checkpoint"):
        DeepSpeedCheckpoint("ckpt")


def test_namespace_submodules_load_lazily() -> None:
    code = textwrap.dedent(
        """
        import sys
        import ds_engine
        assert "ds_engine.runtime" not in sys.modules and "ds_engine.ops" not in sys.modules
        assert ds_engine.runtime.zero.Init is ds_engine.zero.Init
        assert "ds_engine.runtime.zero" in sys.modules
        assert "ds_engine.ops.op_builder" not in sys.modules
        assert ds_engine.ops.op_builder.CPUAdamBuilder.NAME == "cpu_adam"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_activation_checkpointing_is_deepspeed_checkpointing() -> None:
    from ds_engine import checkpointing

    alias = importlib.import_module("ds_engine.runtime.activation_checkpointing.checkpointing")
    assert alias is checkpointing


def test_moe_and_adam_submodules_are_the_owners() -> None:
    import ds_moe
    from ds_engine.moe import experts, sharded_moe, utils
    from ds_engine.ops.adam import cpu_adam, fused_adam

    assert utils.is_moe_param is ds_moe.is_moe_param
    assert (
        utils.split_params_into_different_moe_groups_for_optimizer
        is ds_moe.split_params_into_different_moe_groups_for_optimizer
    )
    assert sharded_moe.TopKGate is ds_moe.TopKGate and sharded_moe.MOELayer is ds_moe.MOELayer
    assert experts.Experts is ds_moe.Experts
    assert cpu_adam.DeepSpeedCPUAdam is ds_optim.CPUAdam
    assert fused_adam.FusedAdam is ds_optim.FusedAdam


def test_top_level_names_of_missing_features_refuse_when_called() -> None:
    import ds_engine

    with pytest.raises(NotImplementedError, match=r"deepspeed\.init_inference.*not implemented"):
        ds_engine.init_inference(torch.nn.Linear(2, 2))
    assert "init_inference" in dir(ds_engine)


def test_monitor_namespace_has_deepspeeds_classes() -> None:
    from ds_engine.monitor import comet, config, csv_monitor, monitor, tensorboard, wandb

    disabled = config.get_monitor_config({})
    master = monitor.MonitorMaster(disabled)
    assert master.enabled is False
    assert isinstance(master.tb_monitor, tensorboard.TensorBoardMonitor)
    assert isinstance(master.wandb_monitor, wandb.WandbMonitor)
    assert isinstance(master.csv_monitor, csv_monitor.csvMonitor)
    assert isinstance(master.comet_monitor, comet.CometMonitor)
    assert config.CSVConfig().job_name == "DeepSpeedJobName"


def test_zero_config_and_pipe_module_reexports() -> None:
    from ds_engine.runtime.pipe import module
    from ds_engine.runtime.zero import config, offload_config

    assert config.OffloadDeviceEnum is offload_config.OffloadDeviceEnum
    assert config.DeepSpeedZeroOffloadParamConfig is ds_zero.OffloadParamConfig
    assert module.PipeDataParallelTopology is ds_comm.PipeDataParallelTopology
