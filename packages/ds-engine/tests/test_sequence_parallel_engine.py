"""``sequence_parallel_size`` under the engine: SP=2 trains exactly as SP=1 on the same global
sequences, step by step (the Ulysses data adapter, the token-weighted loss, ZeRO over sp x dp),
on real gloo ranks; the groups and accessors DeepSpeed's clients read."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _sp_testing import (
    LlamaAttentionLM,
    TinyAttentionLM,
    causal_sdpa,
    full_loss,
    make_sample,
    token_loss,
)

_SEQ, _PROMPT, _STEPS = 16, 5, 3  # prompt tokens unlabelled: the two slices weigh 4 and 7 tokens


def _sp_config(stage: int, sp: int = 2) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "sequence_parallel_size": sp,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
    }


def _full_params(engine) -> dict:
    import ds_zero

    params = dict(engine.module.named_parameters())
    with ds_zero.GatheredParameters(list(params.values())):
        return {n: p.detach().cpu().clone() for n, p in params.items()}  # the reference's device


def _train_sp(stage: int, sp: int, axis: str) -> tuple[list[float], list[dict], dict]:
    """SP=``sp`` training through initialize() and the Ulysses adapter: losses and the full
    parameters after every step. ``axis``: where the sequence axis comes from: ``"config"``
    (``sequence_parallel_size``), ``"grid"`` (a ParallelGrid mpu) or ``"state_sp"``
    (DeepSpeed's ``parallel_state_sp`` module as the mpu, no config key)."""
    import torch

    import ds_comm
    import ds_engine
    from ds_engine.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
    from ds_engine.sequence import DistributedAttention, sequence_parallel_loss
    from ds_engine.utils import groups

    rank = ds_comm.get_rank()
    config, mpu = _sp_config(stage, sp), None
    if axis == "grid":
        mpu = ds_comm.ParallelGrid(sp=sp).mpu()
    elif axis == "state_sp":
        from ds_engine.runtime.sequence_parallel import parallel_state_sp as mpu

        mpu.initialize_sequence_parallel(sp)
        del config["sequence_parallel_size"]
    torch.manual_seed(0)
    model = TinyAttentionLM()
    engine, *_ = ds_engine.initialize(model=model, config=config, mpu=mpu)
    sp_group = groups._get_sequence_parallel_group()
    # the attention takes the engine's sequence group (built by initialize from the config)
    model.attention = DistributedAttention(causal_sdpa, sp_group, gather_idx=1)
    mine = [make_sample(1000 * k + rank, _SEQ, prompt=_PROMPT) for k in range(_STEPS)]
    loader = UlyssesSPDataLoaderAdapter(
        mine,
        sp_rank=groups._get_sequence_parallel_rank(),
        sp_group=sp_group,
        sp_world_size=groups._get_sequence_parallel_world_size(),
        device=engine.device,
    )
    assert len(loader) == _STEPS * sp
    losses, params = [], []
    for _, batch in zip(range(_STEPS), loader):
        assert batch["input_ids"].shape == (1, _SEQ // sp)
        batch = {k: v.to(engine.device) for k, v in batch.items()}  # the adapter keeps host slices
        logits = engine(batch["input_ids"], batch["position_ids"])
        loss, tokens = token_loss(logits, batch["shift_labels"])
        loss = sequence_parallel_loss(loss, tokens, engine.seq_parallel_group)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
        params.append(_full_params(engine))
    surface = {
        "sequence_parallel_size": engine.sequence_parallel_size,
        "dp_world_size": engine.dp_world_size,
        "seq_dp_world_size": engine.seq_dp_world_size,
        "train_batch_size": engine.train_batch_size(),
        "group_is_engines": engine.get_sequence_parallel_group() is sp_group,
        "sp_ranks": sorted(torch.distributed.get_process_group_ranks(sp_group)),
    }
    if axis == "state_sp":
        from ds_engine.runtime.sequence_parallel import parallel_state_sp

        parallel_state_sp._release_sequence_parallel_groups()
    return losses, params, surface


def _reference(world_size: int, sp: int) -> tuple[list[list[float]], list[dict]]:
    """SP=1 in this process: each step averages the whole-sequence losses of the samples the
    data-parallel replicas processed (replica ``d``: the batch of its member ``step % sp``)."""
    import torch

    torch.manual_seed(0)
    model = TinyAttentionLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    replicas = world_size // sp
    losses, params = [], []
    for step in range(_STEPS):
        members = [d * sp + step % sp for d in range(replicas)]
        per = [
            full_loss(model, make_sample(1000 * (step // sp) + r, _SEQ, prompt=_PROMPT))
            for r in members
        ]
        loss = torch.stack(per).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append([float(x.detach()) for x in per])
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, params


def _parity_body(rank: int, world_size: int, stages: list[int], axis: str) -> dict:
    import ds_comm

    sp = 2
    ref_losses, ref_params = _reference(world_size, sp)
    replica = ds_comm.get_rank() // sp
    out = {}
    for stage in stages:
        losses, params, surface = _train_sp(stage, sp, axis)
        loss_error = max(abs(a - b[replica]) for a, b in zip(losses, ref_losses))
        param_error = max(
            float((p[n] - r[n]).abs().max()) for p, r in zip(params, ref_params) for n in r
        )
        moved = max(
            float((ref_params[-1][n] - ref_params[0][n]).abs().max()) for n in ref_params[0]
        )
        out[stage] = {"loss": loss_error, "param": param_error, "moved": moved, **surface}
    return out


def _check_two_ranks(stages: list[int], axis: str) -> None:
    for rank, per_stage in enumerate(run_on_ranks(_parity_body, 2, stages, axis, timeout=300)):
        for stage, got in per_stage.items():
            assert got["moved"] > 1e-3, (stage, got)  # the steps changed the weights
            assert got["loss"] < 1e-5 and got["param"] < 1e-5, (rank, stage, got)
            assert got["sequence_parallel_size"] == 2 and got["group_is_engines"]
            assert got["dp_world_size"] == 1 and got["seq_dp_world_size"] == 2
            assert got["train_batch_size"] == 1 and got["sp_ranks"] == [0, 1]


def test_sp2_equals_sp1_two_ranks_zero3() -> None:
    _check_two_ranks([3], "config")


@pytest.mark.slow
def test_sp2_equals_sp1_two_ranks_zero0_1_2_deepspeeds_parallel_state_sp() -> None:
    _check_two_ranks([0, 1, 2], "state_sp")


@pytest.mark.slow
def test_sp2_with_zero3_over_dp2_equals_sp1_four_ranks() -> None:
    results = run_on_ranks(_parity_body, 4, [3, 1], "grid", timeout=600)
    for rank, per_stage in enumerate(results):
        for stage, got in per_stage.items():
            assert got["moved"] > 1e-3, (stage, got)
            assert got["loss"] < 1e-5 and got["param"] < 1e-5, (rank, stage, got)
            assert got["dp_world_size"] == 2 and got["seq_dp_world_size"] == 4
            assert got["train_batch_size"] == 2
            assert got["sp_ranks"] == ([0, 1] if rank < 2 else [2, 3])


def _refusals_body(rank: int, world_size: int) -> dict:
    import ds_comm
    import ds_engine

    def config(**extra):
        return {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6, **extra}

    errors = {}
    for label, kwargs in {
        "indivisible": {"config": config(sequence_parallel_size=3)},
        "mpu without sp": {
            "config": config(sequence_parallel_size=2),
            "mpu": ds_comm.ParallelGrid().mpu(),
        },
        "mesh disagrees": {"config": config(sequence_parallel_size=2), "mesh_param": (2, 1)},
    }.items():
        try:
            ds_engine.initialize(model=TinyAttentionLM(), **kwargs)
        except ds_engine.ConfigError as err:
            errors[label] = str(err)
    engine, *_ = ds_engine.initialize(model=TinyAttentionLM(), config=config(), mesh_param=(1, 2))
    return {
        "errors": errors,
        "mesh_sp": engine.sequence_parallel_size,
        "mesh_dp": engine.dp_world_size,
    }


def test_initialize_refuses_what_it_cannot_split_and_takes_mesh_param() -> None:
    for got in run_on_ranks(_refusals_body, 2, timeout=120):
        errors = got["errors"]
        assert (
            "sequence_parallel_size = 3 does not divide the world size 2" in errors["indivisible"]
        )
        assert "sequence-parallel group of 1 rank(s)" in errors["mpu without sp"]
        assert "mesh_param=(2, 1)" in errors["mesh disagrees"]
        assert got["mesh_sp"] == 2 and got["mesh_dp"] == 1


@pytest.mark.parametrize("value", [0, -2, 1.5, "two", True])
def test_sequence_parallel_size_must_be_a_positive_integer(value) -> None:
    from ds_engine import ConfigError, DeepSpeedConfig

    with pytest.raises(ConfigError, match=r"^sequence_parallel_size = .*positive integer"):
        DeepSpeedConfig.from_dict(
            {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": value}
        )
    parsed = DeepSpeedConfig.from_dict(
        {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2}
    )
    assert parsed.sequence_parallel_size == 2


def test_shard_sequence_shifts_labels_over_the_whole_sequence() -> None:
    import torch

    from ds_engine.sequence import shard_sequence

    batch = {
        "input_ids": torch.arange(8).view(1, 8),
        "position_ids": torch.arange(8).view(1, 8),
        "labels": torch.arange(10, 18).view(1, 8),
        "meta": "kept",
    }
    first, second = (shard_sequence(batch, r, 2) for r in (0, 1))
    assert first["input_ids"].tolist() == [[0, 1, 2, 3]]
    assert second["position_ids"].tolist() == [[4, 5, 6, 7]]
    assert first["shift_labels"].tolist() == [[11, 12, 13, 14]]  # the last predicts slice 2's first
    assert second["shift_labels"].tolist() == [[15, 16, 17, -100]]
    assert "labels" not in first and first["meta"] == "kept"
    with pytest.raises(
        ValueError, match="sequence length 8 is not divisible by the sequence parallel size 3"
    ):
        shard_sequence(batch, 0, 3)


def _sp_tp_body(rank: int, world_size: int) -> dict:
    """sp=2 x tp=2 on 4 ranks (AutoTP's tensor_parallel.autotp_size and sequence_parallel_size
    in one config, one grid) against the single-process model on the whole sequences."""
    import torch

    import ds_engine
    from ds_engine import gather_tp_state_dict
    from ds_engine.sequence import (
        DistributedAttention,
        UlyssesSPDataLoaderAdapter,
        sequence_parallel_loss,
    )

    config = {**_sp_config(1), "tensor_parallel": {"autotp_size": 2}}
    torch.manual_seed(0)
    ref = LlamaAttentionLM()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    torch.manual_seed(0)
    model = LlamaAttentionLM()
    engine, *_ = ds_engine.initialize(model=model, config=config)
    model.attention = DistributedAttention(causal_sdpa, engine.seq_parallel_group, gather_idx=1)
    sp_rank = engine.mpu.get_sequence_parallel_rank()
    mine = [make_sample(1000 * k + sp_rank, _SEQ, prompt=_PROMPT) for k in range(_STEPS)]
    loader = UlyssesSPDataLoaderAdapter(mine, sp_rank, engine.seq_parallel_group, 2, engine.device)
    loss_error = param_error = 0.0
    for step, batch in zip(range(_STEPS), loader):
        batch = {k: v.to(engine.device) for k, v in batch.items()}  # the adapter keeps host slices
        logits = engine(batch["input_ids"], batch["position_ids"])
        loss, tokens = token_loss(logits, batch["shift_labels"])
        loss = sequence_parallel_loss(loss, tokens, engine.seq_parallel_group)
        engine.backward(loss)
        engine.step()
        expected = full_loss(ref, make_sample(1000 * (step // 2) + step % 2, _SEQ, prompt=_PROMPT))
        opt.zero_grad()
        expected.backward()
        opt.step()
        loss_error = max(loss_error, abs(float(loss) - float(expected)))
        merged = gather_tp_state_dict(model)
        for name, value in ref.state_dict().items():
            param_error = max(param_error, float((merged[name] - value).abs().max()))
    return {
        "loss": loss_error,
        "param": param_error,
        "sizes": (engine.sequence_parallel_size, engine.mp_world_size, engine.dp_world_size),
        "local_heads": model.num_heads,
    }


@pytest.mark.slow
def test_sp2_with_autotp2_equals_the_single_process_model_four_ranks() -> None:
    for got in run_on_ranks(_sp_tp_body, 4, timeout=600):
        assert got["sizes"] == (2, 2, 1) and got["local_heads"] == 4, got
        assert got["loss"] < 1e-5 and got["param"] < 1e-5, got


def _checkpoint_body(rank: int, world_size: int, stage: int, path: str) -> dict:
    """Save after one SP=2 step, take a second step; a fresh engine loaded from the checkpoint
    takes the same second step to the same weights."""
    import os

    import torch

    import ds_engine
    from ds_engine.sequence import (
        DistributedAttention,
        UlyssesSPDataLoaderAdapter,
        sequence_parallel_loss,
    )

    samples = [make_sample(1000 * k + rank, _SEQ, prompt=_PROMPT) for k in range(2)]

    def engine_and_loader(seed: int):
        torch.manual_seed(seed)
        model = TinyAttentionLM()
        engine, *_ = ds_engine.initialize(model=model, config=_sp_config(stage))
        group = engine.seq_parallel_group
        model.attention = DistributedAttention(causal_sdpa, group, gather_idx=1)
        return engine, UlyssesSPDataLoaderAdapter(samples, rank, group, 2, engine.device)

    def train_step(engine, batch) -> None:
        loss, tokens = token_loss(
            engine(batch["input_ids"], batch["position_ids"]), batch["shift_labels"]
        )
        engine.backward(sequence_parallel_loss(loss, tokens, engine.seq_parallel_group))
        engine.step()

    engine, loader = engine_and_loader(0)
    batches = [next(loader) for _ in range(2)]
    train_step(engine, batches[0])
    engine.save_checkpoint(path, tag="one")
    train_step(engine, batches[1])
    expected = _full_params(engine)
    fresh, _ = engine_and_loader(1)
    fresh.load_checkpoint(path, tag="one")
    train_step(fresh, batches[1])
    got = _full_params(fresh)
    return {
        "error": max(float((got[n] - expected[n]).abs().max()) for n in expected),
        "files": sorted(os.listdir(os.path.join(path, "one"))),
        "steps": fresh.global_steps,
    }


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_sp2_checkpoint_round_trip(stage: int, tmp_path: Path) -> None:
    results = run_on_ranks(_checkpoint_body, 2, stage, str(tmp_path), timeout=300)
    for got in results:
        assert got["error"] == 0.0 and got["steps"] == 2, got
        assert "mp_rank_00_model_states.pt" in got["files"], got["files"]


def test_the_adapter_needs_position_ids_and_dict_batches() -> None:
    import torch

    from ds_engine.sequence import UlyssesSPDataLoaderAdapter

    ids = torch.zeros(1, 4, dtype=torch.long)
    for batch, message in (
        ({"input_ids": ids}, "needs 'position_ids'"),
        ((ids,), "must be a dict with 'input_ids'"),
        ({"input_ids": ids, "position_ids": ids[:, :2]}, "position_ids has shape"),
    ):
        adapter = UlyssesSPDataLoaderAdapter([batch], 0, None, 2, "cpu")
        assert len(adapter) == 2
        with pytest.raises(ValueError, match=message):
            next(adapter)


def test_alst_pieces_import_and_refuse_by_name() -> None:
    from ds_engine.runtime.sequence_parallel import ulysses_sp

    with pytest.raises(NotImplementedError, match="register_with_transformers"):
        ulysses_sp.UlyssesSPAttentionHF.register_with_transformers(model_name_or_path="m")
    for name in ("UlyssesSPAttentionHF", "TiledMLP", "TiledFusedLogitsLoss"):
        with pytest.raises(NotImplementedError, match=f"ulysses_sp.{name} .*not implemented"):
            getattr(ulysses_sp, name)()


def test_sequence_parallel_loss_in_one_process_is_the_loss() -> None:
    import torch

    from ds_engine.sequence import sequence_parallel_loss

    loss = torch.tensor(2.5, requires_grad=True)
    out = sequence_parallel_loss(loss, 3, None)
    out.backward()
    assert float(out.detach()) == 2.5 and loss.grad is not None and float(loss.grad) == 1.0
    with pytest.raises(ValueError, match="expected a scalar loss tensor"):
        sequence_parallel_loss(torch.ones(2), 3, None)


def test_parallel_state_sp_says_what_is_missing() -> None:
    from ds_engine.runtime.sequence_parallel import parallel_state_sp

    with pytest.raises(RuntimeError, match="initialize_sequence_parallel"):
        parallel_state_sp.get_sequence_parallel_group()
    for size in (1, 0, 2.0):
        with pytest.raises(ValueError, match="must be an integer > 1"):
            parallel_state_sp.initialize_sequence_parallel(size)  # type: ignore[arg-type]
