"""Mixed precision and placement: fp16/bf16 cast parameters only (buffers stay fp32, as in
DeepSpeed), ``data_types.buffer_dtype`` and ``keep_in_fp32_modules``, and the engine's device,
local rank and world sizes from the accelerator and the launcher."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _engine_testing import config


def _rotary_model():
    import torch
    from torch import nn

    class Rotary(nn.Module):
        """A linear layer whose input is rotated by positions, with Llama's ``inv_freq``."""

        _keep_in_fp32_modules_strict = ["scale"]

        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.proj = nn.Linear(8, 8)
            self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2) / 8)))
            self.register_buffer("scale", torch.full((8,), 1.0 + 1e-3))
            self.register_buffer("steps", torch.zeros((), dtype=torch.long))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(x.shape[0], dtype=self.inv_freq.dtype)
            angles = torch.outer(pos, self.inv_freq).repeat(1, 2)
            return self.proj(x * angles.cos().to(x.dtype) * self.scale.to(x.dtype))

    return Rotary()


def _dtypes(engine) -> dict[str, str]:
    module = engine.module
    out = {name: str(b.dtype) for name, b in module.named_buffers()}
    out["weight"] = str(module.proj.weight.dtype)
    return out


def _precision_body(rank: int, world_size: int, mode: str, data_types: dict | None) -> dict:
    import torch

    import ds_engine

    extra: dict = {mode: {"enabled": True}}
    if mode == "fp16":
        extra[mode]["initial_scale_power"] = 8
    if data_types is not None:
        extra["data_types"] = data_types
    engine, *_ = ds_engine.initialize(model=_rotary_model(), config=config(**extra))
    x = torch.randn(64, 8).to(engine.module.proj.weight.dtype)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    return _dtypes(engine)


@pytest.mark.parametrize("mode", ["bf16", "fp16"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_buffers_stay_fp32_under_mixed_precision(world_size: int, mode: str) -> None:
    low = "torch.bfloat16" if mode == "bf16" else "torch.float16"
    for got in run_on_ranks(_precision_body, world_size, mode=mode, data_types=None, timeout=300):
        assert got == {
            "inv_freq": "torch.float32",
            "scale": "torch.float32",
            "steps": "torch.int64",
            "weight": low,
        }


def test_buffer_dtype_casts_buffers_except_those_kept_in_fp32() -> None:
    data_types = {"buffer_dtype": "bf16"}  # keep_in_fp32_modules "auto": the model's own list
    (got,) = run_on_ranks(_precision_body, 1, mode="bf16", data_types=data_types, timeout=300)
    assert got == {
        "inv_freq": "torch.bfloat16",
        "scale": "torch.float32",  # _keep_in_fp32_modules_strict
        "steps": "torch.int64",
        "weight": "torch.bfloat16",
    }
    data_types = {"buffer_dtype": "fp16", "keep_in_fp32_modules": ["inv_*"]}
    (got,) = run_on_ranks(_precision_body, 1, mode="fp16", data_types=data_types, timeout=300)
    assert got["inv_freq"] == "torch.float32" and got["scale"] == "torch.float16"


def _rotary_loss_body(rank: int, world_size: int) -> list[float]:
    """The loss of the bf16 engine against the same bf16 weights with an fp32 ``inv_freq``
    (DeepSpeed's numerics) and with a bf16 one (what casting buffers gave)."""
    import torch

    import ds_engine

    engine, *_ = ds_engine.initialize(model=_rotary_model(), config=config(bf16={"enabled": True}))
    reference = _rotary_model()
    reference.proj.to(torch.bfloat16)
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.no_grad():
        ours = engine(x).float()
        deepspeed = reference(x).float()
        reference.inv_freq = reference.inv_freq.to(torch.bfloat16)
        cast = reference(x).float()
    return [float((ours - deepspeed).abs().max()), float((ours - cast).abs().max())]


def test_bf16_outputs_match_fp32_buffer_numerics() -> None:
    ((same, cast),) = run_on_ranks(_rotary_loss_body, 1, timeout=300)
    assert same == 0.0 and cast > 0.0


def _placement_body(rank: int, world_size: int) -> dict:
    import argparse

    import torch

    import ds_engine
    from ds_comm.accelerator import get_accelerator

    engine, *_ = ds_engine.initialize(model=_rotary_model(), config=config())
    by_device_rank, *_ = ds_engine.initialize(
        args=argparse.Namespace(device_rank=rank), model=_rotary_model(), config=config()
    )
    accelerator_device = torch.device(get_accelerator().current_device_name())
    tensors = [*engine.module.parameters(), *engine.module.buffers()]
    return {
        "device": engine.device == accelerator_device,
        "device_rank": by_device_rank.device == torch.device(get_accelerator().device_name(rank)),
        "placed": all(t.device == engine.device for t in tensors),
        "local_rank": engine.local_rank,
        "ranks": (engine.global_rank, engine.world_size, engine.dp_world_size),
        "sizes": (engine.mp_world_size, engine.seq_dp_world_size),
        "dp_rank": engine.get_data_parallel_rank(),
        "mp_rank": (engine.get_model_parallel_rank(), engine.get_tensor_parallel_rank()),
        "sp_group": engine.get_sequence_parallel_group(),
        # the torch optimizer the ZeRO optimizer steps (DeepSpeed's basic_optimizer)
        "basic": isinstance(engine.basic_optimizer, torch.optim.Optimizer)
        and engine.basic_optimizer is engine.optimizer.optimizer,
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_device_ranks_and_sizes(world_size: int) -> None:
    for rank, got in enumerate(run_on_ranks(_placement_body, world_size, timeout=300)):
        assert got["device"] and got["device_rank"] and got["placed"]
        assert got["local_rank"] == rank  # the launcher's LOCAL_RANK
        assert got["ranks"] == (rank, world_size, world_size)
        assert got["sizes"] == (1, world_size)
        assert got["dp_rank"] == rank and got["mp_rank"] == (0, 0) and got["sp_group"] is None
        assert got["basic"]
