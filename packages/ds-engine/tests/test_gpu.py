"""The GPU tier of the engine (``pytest -m gpu``; skipped without CUDA).

On one GPU: ZeRO stages 0-3 in fp32, bf16 and fp16 against a single-process reference on the
same device, CPU offload, ``zero.Init`` and ``GatheredParameters`` partitioning onto the device,
checkpoints moving between GPU and CPU, and two ranks sharing the GPU over gloo (one GPU cannot
host two NCCL ranks). Each body checks where the engine put things: parameters, buffers and
optimizer state on the accelerator's device.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _engine_testing import config, loss_of, make_dataset, make_mlp, max_error, reference_adam

pytestmark = pytest.mark.gpu

STEPS = 4
# Relative error of the weights after STEPS Adam steps against the fp32 reference.
TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 1e-2}


def _cfg(stage: int, dtype: str, **zero: object) -> dict:
    section = {"stage": stage, **zero}
    if stage == 3:
        section.setdefault("stage3_param_persistence_threshold", 0)
    extra: dict = {}
    if dtype == "bf16":
        extra["bf16"] = {"enabled": True}
    if dtype == "fp16":
        extra["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return config(zero_optimization=section, **extra)


def _on_device(tensor, device) -> bool:
    return tensor.device.type == device.type and (
        device.index is None or tensor.device.index == device.index
    )


def _parity_body(rank: int, world_size: int, *, stage: int, dtype: str, offload: bool) -> float:
    import torch

    import ds_engine
    from ds_comm.accelerator import get_accelerator

    device = torch.device(get_accelerator().current_device_name())
    assert device.type == "cuda", device
    zero = {"offload_optimizer": {"device": "cpu", "pin_memory": True}} if offload else {}
    model = make_mlp(0)
    engine, _, _, _ = ds_engine.initialize(
        model=model, model_parameters=model.parameters(), config=_cfg(stage, dtype, **zero)
    )
    assert engine.device == device
    assert all(_on_device(p, device) for p in engine.module.parameters())
    data = make_dataset(4 * world_size * STEPS)
    batches = [
        [t.to(device) for t in data[i : i + 4 * world_size]]
        for i in range(0, len(data), 4 * world_size)
    ]
    for batch in batches:
        mine = [t[rank * 4 : (rank + 1) * 4] for t in batch]
        loss = loss_of(engine, mine)
        engine.backward(loss)
        engine.step()
    reference = reference_adam(make_mlp(0).to(device), batches)
    if stage == 3:
        with ds_engine.zero.GatheredParameters(list(engine.module.parameters())):
            return max_error(engine.module, reference)
    return max_error(engine.module, reference)


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_matches_the_reference_on_one_gpu(stage: int, dtype: str) -> None:
    (error,) = run_on_ranks(
        _parity_body, 1, backend="nccl", stage=stage, dtype=dtype, offload=False
    )
    assert error <= TOLERANCE[dtype], error


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_on_two_ranks_sharing_the_gpu_over_gloo(stage: int) -> None:
    # Both ranks on cuda:0: the engine's device follows LOCAL_RANK, as in DeepSpeed.
    errors = run_on_ranks(
        _parity_body, 2, env={"LOCAL_RANK": "0"}, stage=stage, dtype="fp32", offload=False
    )
    assert max(errors) <= TOLERANCE["fp32"], errors


@pytest.mark.parametrize("stage", [2, 3])
def test_cpu_offload_matches_the_reference(stage: int) -> None:
    (error,) = run_on_ranks(
        _parity_body, 1, backend="nccl", stage=stage, dtype="bf16", offload=True
    )
    assert error <= TOLERANCE["bf16"], error


def _zero_init_body(rank: int, world_size: int) -> bool:
    import torch

    import ds_engine
    from ds_comm.accelerator import get_accelerator

    device = torch.device(get_accelerator().current_device_name())
    cfg = _cfg(3, "fp32")
    with ds_engine.zero.Init(config_dict_or_path=cfg):
        model = make_mlp(0)
    reference = make_mlp(0)
    for p in model.parameters():
        assert p.numel() == 0 and p.ds_numel > 0
        assert _on_device(p.ds_tensor, device), p.ds_tensor.device
    with ds_engine.zero.GatheredParameters(list(model.parameters())):
        for p, q in zip(model.parameters(), reference.parameters()):
            assert _on_device(p, device)
            torch.testing.assert_close(p.detach().cpu(), q.detach())
    return True


def test_zero_init_partitions_straight_onto_the_device() -> None:
    assert run_on_ranks(_zero_init_body, 1, backend="nccl") == [True]


def _save_body(rank: int, world_size: int, *, path: str, device_name: str) -> list[float]:
    import ds_engine

    model = make_mlp(0)
    engine, _, loader, _ = ds_engine.initialize(
        model=model, config=_cfg(2, "fp32"), training_data=make_dataset(32)
    )
    assert engine.device.type == device_name
    losses = []
    for batch in loader:
        loss = loss_of(engine, [t.to(engine.device) for t in batch])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.save_checkpoint(path, tag="t")
    return [float(p.detach().float().sum()) for p in engine.module.parameters()] + losses[-1:]


def _load_body(rank: int, world_size: int, *, path: str, device_name: str) -> list[float]:
    import ds_engine

    model = make_mlp(1)
    engine, _, _, _ = ds_engine.initialize(model=model, config=_cfg(2, "fp32"))
    engine.load_checkpoint(path, tag="t")
    assert engine.device.type == device_name
    return [float(p.detach().float().sum()) for p in engine.module.parameters()]


@pytest.mark.parametrize(("saved_on", "loaded_on"), [("cuda", "cpu"), ("cpu", "cuda")])
def test_checkpoint_moves_between_gpu_and_cpu(
    saved_on: str, loaded_on: str, tmp_path: Path
) -> None:
    def run(body, device_name: str) -> list[float]:
        # DS_ACCELERATOR picks the accelerator before ds_comm is first imported (fresh workers).
        return run_on_ranks(
            body, 1, backend="nccl" if device_name == "cuda" else "gloo", fresh=True,
            env={"DS_ACCELERATOR": device_name}, path=str(tmp_path), device_name=device_name,
        )[0]  # fmt: skip

    saved = run(_save_body, saved_on)
    loaded = run(_load_body, loaded_on)
    assert loaded == pytest.approx(saved[:-1], rel=1e-6)


def _loader_body(rank: int, world_size: int) -> bool:
    import torch

    import ds_engine

    model = make_mlp(0)
    data = make_dataset(16)
    engine, _, loader, _ = ds_engine.initialize(
        model=model, config=_cfg(2, "fp32"), training_data=data
    )
    assert loader is not None
    x, y = next(iter(loader))
    assert x.device == engine.device and y.device == engine.device, (x.device, y.device)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    return True


def test_deepspeed_io_batches_arrive_on_the_engines_device() -> None:
    assert run_on_ranks(_loader_body, 1, backend="nccl") == [True]
