"""``deepspeed.X.Y`` is ``ds_engine.X.Y``: one module object, whatever the import order."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import deepspeed
import pytest
from deepspeed import _alias

import ds_engine

# Paths this distribution must provide (those of ds-engine's namespace modules, and the two
# names of one module: runtime.activation_checkpointing.checkpointing is checkpointing).
PATHS = [
    "comm",
    "accelerator",
    "checkpointing",
    "launcher",
    "launcher.runner",
    "launcher.launch",
    "utils",
    "utils.groups",
    "utils.logging",
    "utils.zero_to_fp32",
    "runtime.activation_checkpointing",
    "runtime.activation_checkpointing.checkpointing",
    "zero",
    "runtime",
    "runtime.zero",
    "runtime.zero.partition_parameters",
    "runtime.zero.config",
    "runtime.zero.offload_config",
    "runtime.zero.stage3",
    "runtime.zero.stage_1_and_2",
    "runtime.pipe",
    "runtime.pipe.module",
    "runtime.pipe.engine",
    "runtime.pipe.topology",
    "runtime.pipe.schedule",
    "runtime.utils",
    "runtime.config",
    "runtime.engine",
    "runtime.lr_schedules",
    "runtime.base_optimizer",
    "runtime.dataloader",
    "runtime.fp16",
    "runtime.fp16.loss_scaler",
    "runtime.data_pipeline",
    "runtime.data_pipeline.curriculum_scheduler",
    "runtime.progressive_layer_drop",
    "runtime.zero.offload_config",
    "ops",
    "ops.adam",
    "ops.adam.cpu_adam",
    "ops.adam.fused_adam",
    "ops.lamb",
    "ops.lion",
    "ops.adagrad",
    "ops.aio",
    "ops.op_builder",
    "ops.op_builder.builder",
    "ops.op_builder.all_ops",
    "checkpoint",
    "checkpoint.utils",
    "monitor",
    "monitor.monitor",
    "monitor.config",
    "monitor.tensorboard",
    "monitor.wandb",
    "monitor.csv_monitor",
    "monitor.comet",
    "profiling",
    "profiling.flops_profiler",
    "pipe",
    "moe",
    "moe.layer",
    "moe.utils",
    "moe.sharded_moe",
    "moe.experts",
    "sequence",
    "sequence.layer",
    "env_report",
]

SECOND_NAMES = {"runtime.activation_checkpointing.checkpointing": "ds_engine.checkpointing"}


@pytest.mark.parametrize("path", PATHS)
def test_module_is_the_ds_engine_module(path: str) -> None:
    alias = importlib.import_module(f"deepspeed.{path}")
    real = importlib.import_module(f"ds_engine.{path}")
    assert alias is real
    assert sys.modules[f"deepspeed.{path}"] is sys.modules[f"ds_engine.{path}"]
    # The module keeps its own identity: name and spec are ds_engine's (the name of the module
    # itself, ds_engine.checkpointing, for its second path under runtime.activation_checkpointing).
    assert real.__name__ == SECOND_NAMES.get(path, f"ds_engine.{path}")
    assert real.__spec__ is not None and real.__spec__.name == real.__name__


def test_alias_imported_first_then_monkeypatched_through_it() -> None:
    # A fresh interpreter: the deepspeed name comes first, ds_engine's after; a monkeypatch
    # through one name is seen through the other.
    code = textwrap.dedent(
        """
        import deepspeed.runtime.zero.partition_parameters as pp
        from deepspeed.runtime.zero import partition_parameters as pp2
        import ds_engine.runtime.zero.partition_parameters as real
        assert pp is pp2 is real and real.__spec__.name == real.__name__
        original = pp.zero_wrapper_for_fp_tensor_constructor
        pp.zero_wrapper_for_fp_tensor_constructor = "patched"
        assert real.zero_wrapper_for_fp_tensor_constructor == "patched"
        pp.zero_wrapper_for_fp_tensor_constructor = original
        import deepspeed
        assert deepspeed.runtime.zero.partition_parameters is real
        assert deepspeed.zero.partition_parameters is real
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        import ds_zero
        assert DeepSpeedZeroOptimizer_Stage3 is ds_zero.Stage3Optimizer
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_import_deepspeed_loads_no_submodule() -> None:
    code = textwrap.dedent(
        """
        import sys
        import deepspeed
        loaded = {m for m in sys.modules if m.startswith(("ds_engine.", "deepspeed."))}
        lazy = {"runtime", "ops", "zero", "pipe", "moe", "checkpoint", "profiling", "sequence"}
        assert not {m for m in loaded if m.split(".")[1] in lazy}, sorted(loaded)
        assert deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES
        assert "ds_engine.runtime" in sys.modules
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_top_level_names_are_ds_engine_names() -> None:
    assert deepspeed.initialize is ds_engine.initialize
    assert deepspeed.init_distributed is ds_engine.init_distributed
    assert deepspeed.add_config_arguments is ds_engine.add_config_arguments
    assert deepspeed.DeepSpeedEngine is ds_engine.DeepSpeedEngine
    assert deepspeed.DeepSpeedConfig is ds_engine.DeepSpeedConfig
    assert deepspeed.zero is ds_engine.zero and deepspeed.comm is ds_engine.comm
    assert deepspeed.zero.Init is ds_engine.runtime.zero.Init
    assert deepspeed.PipelineModule is ds_engine.pipe.PipelineModule
    assert deepspeed.DeepSpeedOptimizer is ds_engine.runtime.base_optimizer.DeepSpeedOptimizer
    from deepspeed import DeepSpeedEngine, comm

    assert DeepSpeedEngine is ds_engine.DeepSpeedEngine and comm is ds_engine.comm
    names = dir(deepspeed)
    for name in ("initialize", "runtime", "zero", "ops", "__version__", "git_hash"):
        assert name in names
    assert "initialize" in deepspeed.__all__ and "__git_hash__" in deepspeed.__all__


def test_unknown_attribute_names_ds_engine() -> None:
    with pytest.raises(AttributeError, match=r"no attribute 'no_such_name'.*ds_engine"):
        _ = deepspeed.no_such_name


def test_unknown_path_names_the_ds_engine_module() -> None:
    with pytest.raises(ModuleNotFoundError, match=r"ds_engine\.no_such_module") as info:
        importlib.import_module("deepspeed.no_such_module.inner")
    assert info.value.name == "deepspeed.no_such_module"  # the parent fails first
    with pytest.raises(ModuleNotFoundError, match=r"'ds_engine\.runtime\.no_such_module'"):
        importlib.import_module("deepspeed.runtime.no_such_module")
    assert "deepspeed.no_such_module" not in sys.modules


def test_a_missing_dependency_is_not_blamed_on_the_path() -> None:
    # ds_engine.<rest> exists but imports something missing: that error is raised unchanged.
    assert _alias._is_prefix("ds_engine.runtime", "ds_engine.runtime.zero")
    assert _alias._is_prefix("ds_engine.runtime.zero", "ds_engine.runtime.zero")
    assert not _alias._is_prefix("ds_moe", "ds_engine.moe")
    assert not _alias._is_prefix("ds_engine.run", "ds_engine.runtime")


def test_own_modules_are_not_aliased() -> None:
    from deepspeed import git_version_info

    assert git_version_info.__name__ == "deepspeed.git_version_info"
    assert git_version_info.version == deepspeed.__version__
    installed = git_version_info.installed_ops
    assert installed["async_io"] is True and installed["transformer_inference"] is False
    assert git_version_info.compatible_ops == installed
    assert git_version_info.torch_info["version"].count(".") >= 1


def test_install_is_idempotent() -> None:
    finder = _alias.install()
    assert _alias.install() is finder
    assert sum(isinstance(f, _alias.AliasFinder) for f in sys.meta_path) == 1
