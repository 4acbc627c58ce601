"""ZeRO++ (qwZ, qgZ, hpZ) and MiCS through ``initialize()`` on 4 gloo ranks: they train next to
plain ZeRO-3 (MiCS to fp32 rounding, ZeRO++ within its quantization tolerance, see
``packages/ds-zero/tests/test_zeropp.py``), and an engine checkpoint of each reloads into a
fresh engine with the same loss. The GPU tier (``pytest -m gpu``) runs the same on four ranks
sharing one GPU over gloo with CUDA tensors (one GPU cannot host several NCCL ranks), where the
quantization takes ds-kernels' Triton path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ds_testing import run_on_ranks

SECTIONS: dict[str, dict[str, Any]] = {
    "plain": {},
    "mics": {"mics_shard_size": 2},
    "zeropp": {
        "zero_quantized_weights": True,
        "zero_quantized_gradients": True,
        "zero_hpz_partition_size": 2,
    },
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def _body(rank: int, world_size: int, *, path: str, gpu: bool = False) -> dict[str, list[float]]:
    import ds_engine

    generator = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator)
    if gpu:
        x, y = x.cuda(), y.cuda()
    out = {}
    for name, extra in SECTIONS.items():
        zero = {"stage": 3, "stage3_param_persistence_threshold": 0, **extra}
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
            "zero_optimization": zero,
        }
        model = _model()
        engine, *_ = ds_engine.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        assert engine.zero_quantized_weights() is bool(extra.get("zero_quantized_weights"))
        assert engine.device.type == ("cuda" if gpu else "cpu")
        losses = []
        for _ in range(3):
            loss = ((engine(x) - y) ** 2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.save_checkpoint(f"{path}/{name}", tag="t")
        fresh = _model()
        loaded, *_ = ds_engine.initialize(
            model=fresh, model_parameters=fresh.parameters(), config=config
        )
        loaded.load_checkpoint(f"{path}/{name}", tag="t")
        with torch.no_grad():
            after = ((engine(x) - y) ** 2).mean().item()
            assert ((loaded(x) - y) ** 2).mean().item() == after
        out[name] = [*losses, after]
        engine.destroy()
        loaded.destroy()
    assert out["mics"] == pytest.approx(out["plain"], rel=1e-5)
    assert out["zeropp"] == pytest.approx(out["plain"], rel=0.02)
    return out


@pytest.mark.slow  # ~8 s warm on 4 ranks; the config-json examples cover initialize() by default
def test_zeropp_and_mics_train_and_reload_through_the_engine(tmp_path: Path) -> None:
    run_on_ranks(_body, 4, path=str(tmp_path), timeout=600)


@pytest.mark.gpu
def test_zeropp_and_mics_on_four_ranks_sharing_the_gpu(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    # All ranks on cuda:0 (LOCAL_RANK=0); gloo moves the CUDA tensors.
    run_on_ranks(_body, 4, env={"LOCAL_RANK": "0"}, path=str(tmp_path), gpu=True, timeout=600)
