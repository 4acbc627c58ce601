"""NVMe optimizer offload through the engine: the ``aio`` section, the swapper the engine builds,
the same training as CPU offload on real gloo ranks, and the errors for what is not there."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _engine_testing import config, loss_of, make_dataset, make_mlp

from ds_engine import ConfigError, DeepSpeedConfig


def _nvme_zero(root: str) -> dict:
    return {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": root}}


def _train(rank: int, world_size: int, zero: dict, steps: int) -> tuple[list[float], object]:
    import torch

    import ds_engine

    aio = {"block_size": 65536, "queue_depth": 4, "intra_op_parallelism": 2}
    engine, *_ = ds_engine.initialize(
        model=make_mlp(), config=config(zero_optimization=zero, aio=aio)
    )
    data = make_dataset(4 * world_size * 2)
    losses = []
    for step in range(steps):  # two global batches, alternately: the loss must fall
        start = ((step % 2) * world_size + rank) * 4
        batch = [t[start : start + 4] for t in data.tensors]
        loss = loss_of(engine, batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    return losses, (engine, params)


def _nvme_equals_cpu_body(rank: int, world_size: int, *, root: str, stage: int) -> list[str]:
    import torch

    cpu = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    nvme = {**_nvme_zero(root), "stage": stage}
    cpu_losses, (_, cpu_params) = _train(rank, world_size, cpu, steps=10)
    nvme_losses, (engine, nvme_params) = _train(rank, world_size, nvme, steps=10)
    assert nvme_losses == cpu_losses
    assert torch.equal(nvme_params, cpu_params)
    assert sum(nvme_losses[-2:]) < sum(nvme_losses[:2])
    swapper = engine.optimizer._swap.swapper
    assert type(swapper).__name__ == "AsyncTensorSwapper"
    folder = Path(root) / "ds_zero" / f"rank{rank}"
    return sorted(p.name for p in folder.iterdir() if p.stat().st_size > 0)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("stage", [1, 2])
def test_nvme_offload_trains_exactly_like_cpu_offload(
    world_size: int, stage: int, tmp_path: Path
) -> None:
    results = run_on_ranks(
        _nvme_equals_cpu_body, world_size, root=str(tmp_path), stage=stage, timeout=300
    )
    for files in results:
        # Adam's two moments of the one flat group, one swap file each.
        assert files == ["group0_exp_avg.swp", "group0_exp_avg_sq.swp"]
    for rank in range(world_size):
        assert (tmp_path / "ds_zero" / f"rank{rank}").is_dir()


def _infinity_body(rank: int, world_size: int, *, root: str) -> dict:
    import torch

    def gathered(engine) -> torch.Tensor:
        params = list(engine.module.parameters())
        params[0].ds_partitioner.gather(params).wait()
        return torch.cat([p.detach().reshape(-1).clone() for p in params])

    # several sub-groups, so the swap pipeline overlaps their steps; every parameter sharded
    common = {"stage": 3, "sub_group_size": 40, "stage3_param_persistence_threshold": 0}
    offload = {"device": "cpu"}
    cpu = {**common, "offload_optimizer": offload, "offload_param": offload}
    nvme = {"device": "nvme", "nvme_path": root}
    infinity = {**common, "offload_optimizer": nvme, "offload_param": {**nvme, "max_in_cpu": 0}}
    cpu_losses, (cpu_engine, _) = _train(rank, world_size, cpu, steps=6)
    losses, (engine, _) = _train(rank, world_size, infinity, steps=6)
    assert losses == cpu_losses
    assert torch.equal(gathered(engine), gathered(cpu_engine))
    assert sum(losses[-2:]) < sum(losses[:2])
    zero = engine.optimizer
    assert len(zero.masters) > 1 and type(zero._swap.swapper).__name__ == "AsyncTensorSwapper"
    assert zero.partitioner.shard_store.reads > 0  # the parameter shards came from their files
    host = zero.host_memory()
    assert engine.memory_usage().host == sum(host.values())
    return host


def test_zero_infinity_trains_exactly_like_cpu_offload(tmp_path: Path) -> None:
    """ZeRO-3 with the optimizer state and the parameter shards on NVMe, through the config."""
    for host in run_on_ranks(_infinity_body, 2, root=str(tmp_path), timeout=600):
        assert host["pinned_staging"] > 0 and host["optimizer_state"] == 0 and host["masters"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds_zero", "ds_zero_params"]


def test_aio_section_is_parsed_by_ds_offload_aio() -> None:
    from ds_offload_aio import AioConfig

    cfg = DeepSpeedConfig.from_dict(
        {"train_batch_size": 4, "aio": {"queue_depth": 16, "thread_count": 2}}
    )
    assert cfg.aio == AioConfig(queue_depth=16, intra_op_parallelism=2)
    with pytest.raises(ConfigError, match=r"aio\.queue_dept is not a known key"):
        DeepSpeedConfig.from_dict({"train_batch_size": 4, "aio": {"queue_dept": 16}})
    with pytest.raises(ConfigError, match="aio = 3"):
        DeepSpeedConfig.from_dict({"train_batch_size": 4, "aio": 3})


def test_nvme_without_an_aio_section_uses_deepspeed_defaults(tmp_path: Path) -> None:
    from ds_offload_aio import AioConfig

    raw = {"train_batch_size": 4, "zero_optimization": _nvme_zero(str(tmp_path))}
    assert DeepSpeedConfig.from_dict(raw).aio == AioConfig()
    assert DeepSpeedConfig.from_dict({"train_batch_size": 4}).aio is None


def test_nvme_without_ds_offload_aio_names_the_pip_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ds_offload_aio", None)  # import fails as if not installed
    kept = DeepSpeedConfig.from_dict({"train_batch_size": 4, "aio": {"queue_depth": 16}})
    assert kept.aio == {"queue_depth": 16}
    raw = {"train_batch_size": 4, "zero_optimization": _nvme_zero(str(tmp_path))}
    with pytest.raises(ImportError, match="pip install ds-offload-aio"):
        DeepSpeedConfig.from_dict(raw)


def test_gds_is_rejected_for_host_optimizer_state(tmp_path: Path) -> None:
    import ds_engine

    cfg = config(zero_optimization=_nvme_zero(str(tmp_path)), aio={"use_gds": True})
    with pytest.raises(ConfigError, match=r"aio\.use_gds = true"):
        ds_engine.initialize(model=make_mlp(), config=cfg, dist_init_required=False)


def test_nvme_parameter_offload_is_a_stage_3_error(tmp_path: Path) -> None:
    zero = {"stage": 2, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}}
    with pytest.raises(ConfigError, match=r"offload_param.*ZeRO stage 3"):
        DeepSpeedConfig.from_dict({"train_batch_size": 4, "zero_optimization": zero})
