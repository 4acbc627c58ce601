"""``deepspeed.utils``: logger and rank-filtered logging, ``OnDevice``, ``RepeatingLoader``,
``groups`` (without and with an mpu, on 2 gloo ranks) and ``zero_to_fp32`` over an engine
checkpoint (2 ranks, stage 2 and 3), compared with the model's own weights."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _engine_testing import config, loss_of, make_mlp


def test_logger_is_deepspeeds() -> None:
    from ds_engine.utils import logger, set_log_level_from_string
    from ds_engine.utils import logging as ds_logging

    assert logger is logging.getLogger("DeepSpeed") and not logger.propagate
    set_log_level_from_string("info")
    try:
        assert logger.level == logging.INFO and ds_logging.should_log_le("info")
    finally:
        set_log_level_from_string("warning")
    with pytest.raises(ValueError, match="not one of"):
        ds_logging.get_log_level_from_string("loud")


def test_log_dist_without_process_group() -> None:
    from ds_engine.utils import log_dist, logger

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    keep = Keep()
    logger.addHandler(keep)
    logger.setLevel(logging.INFO)
    try:
        log_dist("hello", ranks=[0])
        log_dist("quiet", ranks=[0], level=logging.DEBUG)
    finally:
        logger.setLevel(logging.WARNING)
        logger.removeHandler(keep)
    assert seen == ["[Rank -1] hello"]


def _dist_logging_body(rank: int, world_size: int, folder: str) -> list[str | None]:
    from ds_engine.utils import logging as ds_logging
    from ds_engine.utils import print_json_dist

    print_json_dist({"loss": 1.5}, ranks=[1], path=f"{folder}/m{rank}.json")
    return [
        ds_logging.get_dist_msg("x", ranks=[0]),
        ds_logging.get_dist_msg("x", ranks=[-1]),
        ds_logging.get_dist_msg("x", ranks=None),
    ]


def test_log_dist_rank_filter(tmp_path: Path) -> None:
    got = run_on_ranks(_dist_logging_body, 2, str(tmp_path))
    assert got[0] == ["[Rank 0] x", "[Rank 0] x", None]
    assert got[1] == [None, "[Rank 1] x", None]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m1.json"]
    assert json.loads((tmp_path / "m1.json").read_text()) == {"loss": 1.5, "rank": 1}


def test_get_caller_func() -> None:
    from ds_engine.utils import get_caller_func

    def inner() -> str:
        return get_caller_func(frame=2)

    def outer() -> str:
        return inner()

    assert outer() == "outer"


def test_on_device_meta_and_dtype() -> None:
    from ds_engine.utils import OnDevice

    before = torch.get_default_dtype()
    with OnDevice(dtype=torch.float16, device="meta"):
        layer = torch.nn.Linear(64, 32)
        explicit = torch.zeros(2, dtype=torch.float32)
        index = torch.arange(3)
    assert layer.weight.device.type == "meta" and layer.weight.dtype == torch.float16
    assert explicit.dtype == torch.float32 and explicit.device.type == "meta"
    assert index.dtype == torch.int64
    assert torch.get_default_dtype() == before and torch.zeros(1).device.type == "cpu"
    with OnDevice(dtype=torch.bfloat16, device="meta", enabled=False):
        assert torch.nn.Linear(2, 2).weight.device.type == "cpu"
    with pytest.raises(ValueError, match="floating"):
        OnDevice(dtype=torch.int8)


def test_repeating_loader() -> None:
    from ds_engine.utils import RepeatingLoader

    loader = RepeatingLoader([1, 2, 3])
    assert [next(loader) for _ in range(7)] == [1, 2, 3, 1, 2, 3, 1]
    assert iter(loader) is loader
    with pytest.raises(ValueError, match="no batch"):
        next(RepeatingLoader([]))


class _SequenceMpu:
    """An mpu with a sequence-parallel group of every rank and a data-parallel group of one."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.world = dist.group.WORLD
        rank = dist.get_rank()
        self.single = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_group(self):
        return self.single

    def get_data_parallel_group(self):
        return self.single

    def get_data_parallel_world_size(self) -> int:
        return 1

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_sequence_parallel_group(self):
        return self.world

    def get_sequence_parallel_world_size(self) -> int:
        return 2

    def get_sequence_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank()


def _groups_body(rank: int, world_size: int) -> None:
    from ds_engine.utils import groups

    assert groups.mpu is None
    assert groups._get_data_parallel_world_size() == world_size
    assert groups._get_data_parallel_rank() == rank
    assert list(groups._get_data_parallel_group_ranks()) == list(range(world_size))
    assert groups._get_model_parallel_world_size() == 1
    assert groups._get_sequence_parallel_world_size() == 1
    assert groups._get_sequence_parallel_rank() == 0
    assert groups._get_sequence_data_parallel_world_size() == world_size
    with pytest.raises(KeyError, match="No sequence parallel group"):
        groups._get_sequence_parallel_group()
    with pytest.raises(RuntimeError, match="mpu"):
        groups.get_tensor_model_parallel_world_size()
    with pytest.raises(KeyError, match="ep_size_2"):
        groups._get_expert_parallel_group("ep_size_2")
    groups.mpu = _SequenceMpu()
    try:
        assert groups._get_sequence_parallel_world_size() == 2
        assert groups._get_sequence_parallel_rank() == rank
        assert groups._get_sequence_parallel_group() is groups.mpu.world
        assert groups._get_data_parallel_world_size() == 1
        assert groups.get_tensor_model_parallel_world_size() == 1
        assert groups.get_tensor_model_parallel_src_rank() == rank
    finally:
        groups.mpu = None


def test_groups() -> None:
    run_on_ranks(_groups_body, 2, fresh=True)


def _expert_groups_body(rank: int, world_size: int) -> None:
    import ds_moe
    from ds_engine.utils import groups

    registry = ds_moe.ExpertParallelGroups()
    registry.add(2)
    groups.register_expert_groups(registry)
    assert groups._get_expert_parallel_world_size("ep_size_2") == 2
    assert groups._get_expert_parallel_rank("ep_size_2") == rank % 2
    assert groups._get_expert_data_parallel_world_size("ep_size_2") == world_size // 2
    assert groups._get_max_expert_size() == 2
    assert groups._get_max_expert_size_name() == "ep_size_2"


def test_expert_groups() -> None:
    run_on_ranks(_expert_groups_body, 4, fresh=True)


def _zero_to_fp32_body(rank: int, world_size: int, stage: int, folder: str) -> dict:
    import ds_engine as deepspeed

    model = make_mlp()
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=config(train_micro_batch_size_per_gpu=2, zero_optimization={"stage": stage}),
    )
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        batch = [torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)]
        batch = [t.to(engine.device) for t in batch]
        engine.backward(loss_of(engine, [t.chunk(world_size)[rank] for t in batch]))
        engine.step()
    engine.save_checkpoint(folder, tag="step2")
    from ds_engine.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_to_fp32(tmp_path: Path, stage: int) -> None:
    from ds_engine.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
        main,
    )

    want = run_on_ranks(_zero_to_fp32_body, 2, stage, str(tmp_path / "ckpt"))[0]
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    for name, value in want.items():
        assert torch.equal(state[name], value), name
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "out", tag="step2")
    saved = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert all(torch.equal(saved[n], v) for n, v in want.items())
    convert_zero_checkpoint_to_fp32_state_dict(
        tmp_path / "ckpt", tmp_path / "sharded", max_shard_size=300
    )
    index = json.loads((tmp_path / "sharded" / "pytorch_model.bin.index.json").read_text())
    assert set(index["weight_map"]) == set(state)
    assert len(set(index["weight_map"].values())) > 1
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    halves = torch.load(tmp_path / "bf16" / "pytorch_model.bin", weights_only=True)
    assert all(torch.equal(halves[n], v.to(torch.bfloat16)) for n, v in want.items())
    with pytest.raises(ValueError, match="float8"):
        main([str(tmp_path / "ckpt"), str(tmp_path / "x"), "--dtype", "float8"])
    model = load_state_dict_from_zero_checkpoint(make_mlp(seed=9), tmp_path / "ckpt")
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), want[name]), name
    assert main([str(tmp_path / "ckpt"), str(tmp_path / "cli"), "--safe_serialization"]) == 0
    raw = (tmp_path / "cli" / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert {n for n in header if n != "__metadata__"} == set(want)
    assert {header[n]["dtype"] for n in want} == {"F32"}
    lazy = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt", lazy_mode=True)
    assert all(torch.equal(lazy[n].contiguous(), v) for n, v in want.items())


def _engine_publishes_groups_body(rank: int, world_size: int) -> None:
    import torch

    import ds_comm
    import ds_engine
    import ds_moe
    from ds_engine.utils import groups

    mpu = ds_comm.Mpu(ds_comm.ProcessGrid(ds_comm.ProcessTopology(["data", "model"], [2, 1])))
    model = torch.nn.Linear(4, 4)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    ds_engine.initialize(model=model, config=cfg, mpu=mpu)
    try:
        assert groups.mpu is mpu
        assert groups._get_data_parallel_world_size() == 2
    finally:
        groups.mpu = None
    moe = torch.nn.Sequential(
        ds_moe.MoE(hidden_size=4, expert=torch.nn.Linear(4, 4), num_experts=2, ep_size=2)
    )
    ds_engine.initialize(model=moe, config=cfg)
    assert groups.mpu is None
    assert groups._get_expert_parallel_world_size("ep_size_2") == 2
    assert groups._get_expert_parallel_rank("ep_size_2") == rank


def test_engine_publishes_its_mpu_and_expert_groups() -> None:
    """``deepspeed.utils.groups`` answers from the last engine's mpu and MoE groups."""
    run_on_ranks(_engine_publishes_groups_body, 2, fresh=True)
