"""``deepspeed.ops.op_builder``: builders whose ``load()`` returns ds's prebuilt kernels."""

from __future__ import annotations

import pytest
import torch

import ds_kernels
import ds_native
import ds_offload_aio
import ds_optim
from ds_engine.accelerator import get_accelerator
from ds_engine.ops import op_builder
from ds_engine.ops.op_builder.all_ops import ALL_OPS


def test_cpu_adam_builder_loads_ds_native_without_jit() -> None:
    builder = op_builder.CPUAdamBuilder()
    assert builder.name == "cpu_adam"
    assert builder.is_compatible() == ds_native.native_available()
    if not builder.is_compatible():
        with pytest.raises(RuntimeError, match="cpu_adam"):
            builder.load()
        return
    module = builder.load()
    assert module is ds_native and builder.jit_load() is ds_native
    # The kernel it returns is the one that runs ds's CPU Adam: one step moves a parameter.
    p, g = torch.ones(8), torch.full((8,), 0.5)
    m, v = torch.zeros(8), torch.zeros(8)
    module.adam_step(p, g, m, v, step=1, lr=0.1)
    assert torch.all(p < 1)


def test_builders_of_ops_ds_provides() -> None:
    assert op_builder.FusedAdamBuilder().load() is ds_kernels
    assert op_builder.FusedLambBuilder().load() is ds_optim
    assert op_builder.CPUAdagradBuilder().load().Adagrad is ds_optim.Adagrad
    assert op_builder.CPULionBuilder().load().Lion is ds_optim.Lion
    aio = op_builder.AsyncIOBuilder()
    assert aio.is_compatible() and aio.load().aio_handle is ds_offload_aio.aio_handle


def test_builder_refuses_to_build_an_extension() -> None:
    with pytest.raises(NotImplementedError, match="builds no extension"):
        op_builder.CPUAdamBuilder().builder()


@pytest.mark.parametrize(
    "cls", [op_builder.TransformerBuilder, op_builder.InferenceBuilder, op_builder.QuantizerBuilder]
)
def test_builders_of_missing_ops_refuse(cls: type, capsys: pytest.CaptureFixture[str]) -> None:
    builder = cls()
    assert not builder.is_compatible()
    assert not builder.is_compatible(verbose=True)
    assert "not implemented in ds" in capsys.readouterr().out
    with pytest.raises(NotImplementedError, match=f"{builder.NAME!r}.*not implemented in ds"):
        builder.load()


def test_all_ops_and_accelerator_registry() -> None:
    assert {"cpu_adam", "fused_adam", "async_io", "transformer_inference"} <= set(ALL_OPS)
    accelerator = get_accelerator()
    assert accelerator.get_op_builder("CPUAdamBuilder") is op_builder.CPUAdamBuilder
    created = accelerator.create_op_builder("AsyncIOBuilder")
    assert isinstance(created, op_builder.AsyncIOBuilder)
    assert accelerator.get_op_builder("TransformerBuilder") is op_builder.TransformerBuilder


def test_ops_optimizers_are_ds_optim() -> None:
    from ds_engine.ops import adagrad, aio, lion

    assert lion.DeepSpeedCPULion is ds_optim.Lion and lion.FusedLion is ds_optim.Lion
    assert adagrad.DeepSpeedCPUAdagrad is ds_optim.Adagrad
    assert aio.aio_handle is ds_offload_aio.aio_handle
    assert aio.AsyncIOBuilder is op_builder.AsyncIOBuilder


def test_ds_report_cli(capsys: pytest.CaptureFixture[str]) -> None:
    from ds_engine.env_report import cli_main

    assert cli_main(["--hide_errors_and_warnings"]) == 0
    out = capsys.readouterr().out
    assert "cpu_adam" in out and "ds environment report" in out
    assert "not implemented in ds" not in out
    with pytest.raises(SystemExit):
        cli_main(["--hide_op"])  # abbreviations are off
