"""Curriculum learning and progressive layer drop: DeepSpeed's schedules step by step, the
engine's forward keyword arguments, seqlen-curriculum GPT runs on 2 gloo ranks and the schedules'
state through checkpoints.

The expected difficulties are computed by hand from DeepSpeed's formulas (see
[Note: DeepSpeed's curriculum schedules] in ``ds_engine._curriculum``); the same tables were
checked once against DeepSpeed 0.19.8's own ``CurriculumScheduler``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from ds_comm import ConfigError
from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _engine_testing import config

LINEAR = {
    "min_difficulty": 8,
    "max_difficulty": 64,
    "schedule_type": "fixed_linear",
    "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8},
}
ROOT = {
    "min_difficulty": 8,
    "max_difficulty": 64,
    "schedule_type": "fixed_root",
    "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8, "root_degree": 2},
}
DISCRETE = {
    "min_difficulty": 1,
    "max_difficulty": 3,
    "schedule_type": "fixed_discrete",
    "schedule_config": {"difficulty": [1, 2, 3], "max_step": [5, 10]},
}


def _linear(step: int) -> int:
    """fixed_linear by hand: floor(step/10 * 56 + 8) down to a multiple of 8, within [8, 64]."""
    value = math.floor(step / 10 * 56 + 8)
    return min(max(value - value % 8, 8), 64)


def _theta(step: int, theta: float, gamma: float) -> float:
    return (1 - theta) * math.exp(-gamma * step) + theta


# --- the schedules (no process group) -----------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        # step 5: 5/10 * 56 + 8 = 36 -> 32; step 9: 58.4 -> 58 -> 56; past the total: 64
        (LINEAR, {0: 8, 1: 8, 2: 16, 5: 32, 9: 56, 10: 64, 50: 64}),
        # step 1: sqrt(0.1) * 56 + 8 = 25.7 -> 24; step 4: sqrt(0.4) * 56 + 8 = 43.4 -> 40
        (ROOT, {0: 8, 1: 24, 2: 32, 4: 40, 9: 56, 10: 64}),
        # max_step [5, 10]: 1 up to step 5, 2 up to 10, then 3 for ever
        (DISCRETE, {0: 1, 5: 1, 6: 2, 10: 2, 11: 3, 1000: 3}),
    ],
    ids=["fixed_linear", "fixed_root", "fixed_discrete"],
)
def test_schedules_follow_deepspeeds_formulas(schedule, expected) -> None:
    from ds_engine.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

    scheduler = CurriculumScheduler(schedule)
    assert {step: scheduler.get_difficulty(step) for step in expected} == expected
    assert scheduler.get_current_difficulty() == schedule["min_difficulty"]


def test_fixed_root_rounds_up_to_the_first_multiple_at_or_above_min() -> None:
    """DeepSpeed 0.19's guard: min 5 with steps of 16 starts at 16, never 0."""
    from ds_engine.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

    odd = {
        "min_difficulty": 5,
        "max_difficulty": 100,
        "schedule_type": "fixed_root",
        "schedule_config": {"total_curriculum_step": 7, "difficulty_step": 16, "root_degree": 3},
    }
    scheduler = CurriculumScheduler(odd)
    # step 1: (1/7)^(1/3) * 95 + 5 = 54.6 -> 54 -> 48; step 7: 100 -> 96 (a multiple of 16);
    # step 11: 115.3 -> 112, capped at the max 100
    assert [scheduler.get_difficulty(s) for s in (0, 1, 7, 11)] == [16, 48, 96, 100]


def test_update_difficulty_holds_the_maximum_and_state_round_trips() -> None:
    from ds_engine.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

    scheduler = CurriculumScheduler(LINEAR)
    assert [scheduler.update_difficulty(s) for s in (3, 12)] == [_linear(3), 64]
    assert scheduler.update_difficulty(1) == 64  # the max is kept once reached, as DeepSpeed
    restored = CurriculumScheduler(LINEAR)
    restored.load_state_dict(scheduler.state_dict())
    assert restored.get_current_difficulty() == 64 and restored.get_state() == scheduler.state


def test_custom_schedule_needs_its_function() -> None:
    from ds_engine.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

    scheduler = CurriculumScheduler(
        {"min_difficulty": 2, "max_difficulty": 9, "schedule_type": "custom"}
    )
    with pytest.raises(RuntimeError, match="set_custom_curriculum_learning_schedule"):
        scheduler.update_difficulty(1)
    scheduler.set_custom_get_difficulty(lambda step: min(2 + step, 9))
    assert [scheduler.update_difficulty(s) for s in (1, 3, 20)] == [3, 5, 9]


def test_progressive_layer_drop_theta() -> None:
    from ds_engine.runtime.progressive_layer_drop import ProgressiveLayerDrop

    pld = ProgressiveLayerDrop(theta=0.5, gamma=0.01)
    assert pld.get_state() == {"progressive_layer_drop": True, "pld_theta": 1.0}
    for step in (0, 1, 100, 1000):
        pld.update_state(step)
        assert pld.get_theta() == pytest.approx(_theta(step, 0.5, 0.01), rel=1e-12)
    assert pld.get_theta() == pytest.approx(0.5, abs=1e-4)


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"curriculum_learning": {**LINEAR, "enabled": True}}, "curriculum_type"),
        (
            {
                "curriculum_learning": {
                    **LINEAR,
                    "enabled": True,
                    "curriculum_type": "seqlen",
                    "schedule_type": "fixed_lineer",
                }
            },
            "schedule_type = 'fixed_lineer'",
        ),
        (
            {
                "curriculum_learning": {
                    **ROOT,
                    "enabled": True,
                    "curriculum_type": "seqlen",
                    "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8},
                }
            },
            "schedule_config.root_degree is required",
        ),
        (
            {
                "curriculum_learning": {
                    **DISCRETE,
                    "enabled": True,
                    "curriculum_type": "x",
                    "schedule_config": {"difficulty": [1, 2], "max_step": [1, 2]},
                }
            },
            "one more difficulty than max steps",
        ),
        ({"progressive_layer_drop": {"enabled": True, "theta": 1.5}}, "theta = 1.5"),
        ({"progressive_layer_drop": {"enabled": True, "gama": 0.1}}, "did you mean 'gamma'"),
    ],
)
def test_bad_sections_name_the_key(section, match) -> None:
    from ds_engine import DeepSpeedConfig

    with pytest.raises(ConfigError, match=match):
        DeepSpeedConfig.from_dict({"train_batch_size": 4, **section})


def _metric(**extra) -> dict:
    return {"difficulty_type": "value", "clustering_type": "single_cluster", **LINEAR, **extra}


@pytest.mark.parametrize(
    ("efficiency", "key"),
    [
        ({"data_routing": {"random_ltd": {"enabled": True}}}, "random_ltd.enabled"),
        (
            {
                "data_sampling": {
                    "curriculum_learning": {
                        "enabled": True,
                        "curriculum_metrics": {"rarity": _metric(clustering_type="schedule_based")},
                    }
                }
            },
            "rarity.clustering_type",
        ),
        ({"data_sampling": {"dynamic_batching": {"enabled": True}}}, "dynamic_batching.enabled"),
    ],
    ids=["random_ltd", "index_based_sampling", "dynamic_batching"],
)
def test_unimplemented_data_efficiency_parts_are_refused(efficiency, key) -> None:
    from ds_engine import DeepSpeedConfig

    with pytest.raises(ConfigError) as err:
        DeepSpeedConfig.from_dict({"train_batch_size": 4, "data_efficiency": efficiency})
    assert f"data_efficiency.data_{'routing' if 'ltd' in key else 'sampling'}." in str(err.value)
    assert key in str(err.value) and "not implemented in ds" in str(err.value)


def test_pipelines_refuse_curriculum_and_pld() -> None:
    from ds_engine import DeepSpeedConfig
    from ds_engine._pipe import check_pipeline_config

    cfg = DeepSpeedConfig.from_dict(
        {"train_batch_size": 4, "progressive_layer_drop": {"enabled": True, "theta": 0.5}}
    )
    with pytest.raises(ConfigError, match=r"progressive_layer_drop\.enabled = true with a Pipe"):
        check_pipeline_config(cfg)


# --- the engine on 2 ranks ----------------------------------------------------------------------

VOCAB, SEQ = 32, 64


def _tiny_gpt():
    """A two-block causal LM that takes DeepSpeed's curriculum / PLD keyword arguments the way
    Megatron's GPT and DeepSpeed's BERT example do, and records what it was given."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mix = nn.Linear(16, 16)

        def forward(self, x):
            causal = torch.cumsum(x, dim=1) / torch.arange(1, x.shape[1] + 1).view(1, -1, 1)
            return x + torch.tanh(self.mix(causal))

    class TinyGPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, 16)
            self.blocks = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(16, VOCAB)
            self.seen: list[dict] = []

        def forward(
            self, tokens, curriculum_seqlen=None, progressive_layer_drop=False, pld_theta=1.0
        ):
            if curriculum_seqlen is not None and curriculum_seqlen < tokens.shape[1]:
                tokens = tokens[:, :curriculum_seqlen]  # Megatron's seqlen truncation
            self.seen.append(
                {
                    "seqlen": tokens.shape[1],
                    "curriculum_seqlen": curriculum_seqlen,
                    "pld": progressive_layer_drop,
                    "theta": pld_theta,
                }
            )
            x = self.embed(tokens[:, :-1])
            for i, block in enumerate(self.blocks):
                keep = 1.0 - (i + 1) / len(self.blocks) * (1.0 - pld_theta)
                if progressive_layer_drop and torch.rand(()) >= keep:
                    continue  # PLD: the layer is skipped this step
                x = block(x)
            logits = self.head(x)
            return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    torch.manual_seed(0)
    return TinyGPT()


def _tokens(rank: int, step: int):
    import torch

    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (2, SEQ), generator=gen)


def _legacy_config(gas: int) -> dict:
    return config(
        gradient_accumulation_steps=gas,
        curriculum_learning={"enabled": True, "curriculum_type": "seqlen", **LINEAR},
        progressive_layer_drop={"enabled": True, "theta": 0.5, "gamma": 0.1},
    )


def _legacy_body(rank: int, world_size: int, *, save_dir: str) -> dict:
    import torch

    import ds_engine as deepspeed

    gas = 2
    engine, *_ = deepspeed.initialize(model=_tiny_gpt(), config=_legacy_config(gas))
    before = [p.detach().clone() for p in engine.module.parameters()]
    losses, thetas = [], []
    for micro in range(14 * gas):
        thetas.append(engine.get_pld_theta())
        loss = engine(_tokens(rank, micro))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if micro == 9:
            engine.save_checkpoint(save_dir, tag="mid")
    engine.eval()
    with torch.no_grad():
        engine(_tokens(rank, 0))  # eval: no curriculum / PLD arguments
    seen = engine.module.seen
    moved = any(not torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))
    # A fresh engine loading step 5 (after 10 micro-batches) continues with the same arguments.
    resumed, *_ = deepspeed.initialize(model=_tiny_gpt(), config=_legacy_config(gas))
    resumed.load_checkpoint(save_dir, tag="mid")
    state = dict(resumed.curriculum_scheduler_legacy.get_state())  # before the forward
    resumed(_tokens(rank, 10))
    return {
        "seen": seen,
        "thetas": thetas,
        "losses": losses,
        "moved": moved,
        "resumed_state": state,
        "resumed_seen": resumed.module.seen[-1],
        "resumed_theta": resumed.get_pld_theta(),
        "accessors": (engine.curriculum_enabled_legacy(), engine.pld_theta(), engine.pld_gamma()),
    }


def test_legacy_seqlen_curriculum_and_pld_reach_the_model_and_train(tmp_path) -> None:
    gas = 2
    for got in run_on_ranks(_legacy_body, 2, save_dir=str(tmp_path), timeout=300):
        train, evaluation = got["seen"][:-1], got["seen"][-1]
        for micro, seen in enumerate(train):
            step = micro // gas  # optimizer steps taken before this micro-batch
            # curriculum: update_difficulty(global_steps + 1) before every training forward
            assert seen["curriculum_seqlen"] == _linear(step + 1), (micro, seen)
            assert seen["seqlen"] == min(_linear(step + 1), SEQ)
            # PLD: theta(t) with t the steps taken before the last boundary (1.0 at first)
            expected = 1.0 if step == 0 else _theta(step - 1, 0.5, 0.1)
            assert seen["pld"] is True and seen["theta"] == pytest.approx(expected, rel=1e-12)
            assert got["thetas"][micro] == pytest.approx(expected, rel=1e-12)
        assert evaluation == {"seqlen": SEQ, "curriculum_seqlen": None, "pld": False, "theta": 1.0}
        assert got["moved"] and all(math.isfinite(x) for x in got["losses"])
        assert got["accessors"] == (True, 0.5, 0.1)
        # saved after 5 steps: the scheduler stood at step 5's difficulty, theta at t = 4
        assert got["resumed_state"]["current_difficulty"] == _linear(5)
        assert got["resumed_seen"]["curriculum_seqlen"] == _linear(6)
        assert got["resumed_theta"] == pytest.approx(_theta(4, 0.5, 0.1), rel=1e-12)


def _sampling_config(schedule: dict) -> dict:
    metric = {"difficulty_type": "value", "clustering_type": "single_cluster", **schedule}
    return config(
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=2,
        data_efficiency={
            "enabled": True,
            "seed": 7,
            "data_sampling": {
                "enabled": True,
                "num_epochs": 3,
                "curriculum_learning": {
                    "enabled": True,
                    "data_cluster_path": "/unused/by/ds",
                    "curriculum_metrics": {"seqlen_truncate": metric},
                },
            },
        },
    )


class _TokenSet:
    """Sequences whose first token is the sample's index (to check which samples ran)."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int):
        import torch

        row = torch.arange(SEQ) % VOCAB
        row[0] = index
        return row


def _truncate(data, state):
    """Megatron's seqlen_truncate post-process: cut the batch to the current difficulty."""
    return data[:, : state["current_difficulties"]["seqlen_truncate"]]


def _sampling_body(rank: int, world_size: int, *, save_dir: str, custom: bool) -> dict:
    import ds_comm
    import ds_engine as deepspeed

    schedule = (
        {"min_difficulty": 4, "max_difficulty": SEQ, "schedule_type": "custom"}
        if custom
        else LINEAR
    )

    def start():
        engine, _, loader, _ = deepspeed.initialize(
            model=_tiny_gpt(), config=_sampling_config(schedule), training_data=_TokenSet()
        )
        if custom:
            engine.set_custom_curriculum_learning_schedule(
                {"seqlen_truncate": lambda step: min(4 * step, SEQ)}
            )
        engine.set_data_post_process_func(_truncate)
        return engine, loader

    engine, loader = start()
    lengths, firsts, batches = [], [], iter(loader)
    for micro in range(16):
        batch = next(batches)
        lengths.append(batch.shape[1])
        firsts.append(batch[:, 0].tolist())
        engine.backward(engine(batch))
        engine.step()
        if micro == 7:
            engine.save_checkpoint(save_dir, tag="mid")
    everyone = [None] * world_size
    ds_comm.all_gather_object(everyone, firsts)
    resumed, resumed_loader = start()
    resumed.load_checkpoint(save_dir, tag="mid")
    again = [b[:, 0].tolist() for b, _ in zip(resumed_loader, range(8))]
    return {
        "lengths": lengths,
        "firsts": firsts,
        "everyone": everyone,
        "again": again,
        "len": len(loader),
        "step": engine.global_steps,
    }


@pytest.mark.parametrize("custom", [False, True], ids=["fixed_linear", "custom"])
def test_data_sampling_curriculum_truncates_as_scheduled(tmp_path, custom: bool) -> None:
    results = run_on_ranks(
        _sampling_body, 2, save_dir=str(tmp_path / "ckpt"), custom=custom, timeout=300
    )
    for got in results:
        # one curriculum step per global batch (2 micro-batches of this rank per step)
        for micro, length in enumerate(got["lengths"]):
            step = micro // 2 + 1
            assert length == (min(4 * step, SEQ) if custom else _linear(step)), (micro, length)
        assert got["step"] == 8 and got["len"] == 3 * 24 // 4  # 3 epochs, 4 samples a micro-step
        # the resumed run draws the same samples as the uninterrupted one
        assert got["again"] == got["firsts"][8:]
    rank0, rank1 = results[0]["everyone"]
    for a, b in zip(rank0, rank1):
        assert not set(a) & set(b)  # each micro-batch split across the ranks
    # the first 24 draws are one whole permutation of the 24 samples
    drawn = [s for micro in zip(rank0, rank1) for part in micro for s in part]
    assert sorted(drawn[:24]) == list(range(24))


def test_curriculum_functions_without_the_curriculum_are_refused() -> None:
    run_on_ranks(_refusal_body, 2, timeout=120)


def _refusal_body(rank: int, world_size: int) -> None:
    import ds_engine as deepspeed

    engine, *_ = deepspeed.initialize(model=_tiny_gpt(), config=config())
    assert engine.get_pld_theta() is None and engine.curriculum_scheduler_legacy is None
    with pytest.raises(RuntimeError, match=r"data_sampling\.curriculum_learning\.enabled"):
        engine.set_data_post_process_func(_truncate)
    with pytest.raises(AttributeError, match="random layer-token drop"):
        engine.random_ltd_initialize()
