"""Checkpoints real DeepSpeed 0.19.8 wrote (``fixtures/deepspeed_0.19.8``, made by
``tools/compat/make_deepspeed_checkpoints.py``) resume in ds on 1 and 2 ranks, and so do a few
that DeepSpeed 0.16.9 wrote (``fixtures/deepspeed_0.16.9``, the oldest release ds reads); crafted
pickles in every file position are refused without running code.

[Note: DeepSpeed resume tolerance]
After loading, ds trains the next three steps and its losses (each averaged over the global
batch) must equal the ones DeepSpeed recorded when it resumed the same checkpoint, within
``TOLERANCE`` (absolute): fp32 1e-6 (measured <= 1.2e-7, the rounding of a different reduction
order across world sizes); bf16 1e-3 (measured <= 1.1e-4); fp16 5e-3 at stages 1-3 (measured
1.9e-3) and 2e-2 at stage 0 (measured 1.3e-2: DeepSpeed's stage-0 fp16 optimizer itself moves
9e-3 away from its stages 1-3 on the same data, and ds follows the stage 1-3 arithmetic).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
import _deepspeed_fixtures as fx

TOLERANCE = {"fp32": 1e-6, "bf16": 1e-3, "fp16": 5e-3}
FP16_STAGE0_TOLERANCE = 2e-2


def _tolerance(dtype: str, stage: int) -> float:
    return FP16_STAGE0_TOLERANCE if (dtype, stage) == ("fp16", 0) else TOLERANCE[dtype]


def _resume_body(
    rank: int, world: int, name: str, stage: int | None, version: str = fx.LATEST
) -> dict:
    case = fx.expected(version)["cases"][name]
    engine = fx.build_engine(fx.config_for(case, world, stage))
    path, client = engine.load_checkpoint(str(fx.fixtures(version) / name))
    result = {
        "path": path,
        "client": {k: client.get(k) for k in ("epoch", "note", "ids")},
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
        "lr": engine.get_lr()[0],
    }
    result["losses"] = fx.train(engine, 3, 3, rank, world, case["dtype"])
    return result


# Default tier: every stage, each dtype, both directions (1 -> 2 and 2 -> 1) among them.
_QUICK = [
    ("zero0_fp32_w1", 2),
    ("zero0_bf16_w2", 1),
    ("zero0_fp16_w2", 2),
    ("zero1_fp32_w2", 1),
    ("zero1_bf16_w1", 2),
    ("zero1_fp16_w2", 1),
    ("zero2_fp32_w1", 2),
    ("zero2_bf16_w2", 1),
    ("zero2_fp16_w2", 2),
    ("zero3_fp32_w2", 1),
    ("zero3_bf16_w1", 2),
    ("zero3_fp16_w2", 1),
]
# DeepSpeed 0.16.9's checkpoints (the oldest release ds reads), each into the other world size.
_QUICK_OLDEST = [
    ("zero0_fp32_w2", 1),
    ("zero1_fp32_w2", 1),
    ("zero2_bf16_w2", 2),
    ("zero3_fp32_w2", 1),
]
_RESUMES = [(fx.LATEST, n, w) for n, w in _QUICK] + [(fx.OLDEST, n, w) for n, w in _QUICK_OLDEST]
_ALL = [
    (name, world)
    for name in sorted(fx.expected()["cases"])
    if name.startswith("zero")
    for world in (1, 2)
]
_SLOW = [c for c in _ALL if c not in _QUICK]


def _check_resume(
    name: str, world: int, stage: int | None = None, version: str = fx.LATEST
) -> None:
    case = fx.expected(version)["cases"][name]
    result = run_on_ranks(_resume_body, world, name, stage, version, timeout=180)[0]
    reference = case["resumed_losses"]
    diff = max(abs(a - b) for a, b in zip(result["losses"], reference))
    tolerance = _tolerance(case["dtype"], case["stage"])
    assert diff <= tolerance, (name, world, result["losses"], reference, diff)
    assert result["client"] == fx.expected(version)["client_state"]
    assert result["global_steps"] == case["global_steps_after_resume"] - 3  # as saved
    assert result["global_samples"] == 3 * fx.GLOBAL_BATCH
    assert result["skipped_steps"] == 0
    assert result["path"].endswith("step3")


@pytest.mark.parametrize(
    ("version", "name", "world"),
    _RESUMES,
    ids=[f"{n}-to-w{w}" if v == fx.LATEST else f"{v}-{n}-to-w{w}" for v, n, w in _RESUMES],
)
def test_deepspeed_checkpoint_resumes_its_loss_trajectory(
    version: str, name: str, world: int
) -> None:
    _check_resume(name, world, version=version)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "world"), _SLOW, ids=[f"{n}-to-w{w}" for n, w in _SLOW])
def test_deepspeed_checkpoint_resumes_every_case(name: str, world: int) -> None:
    _check_resume(name, world)


@pytest.mark.parametrize(("name", "stage"), [("zero3_fp32_w2", 1), ("zero1_fp32_w1", 3)])
def test_deepspeed_checkpoint_loads_at_another_stage(name: str, stage: int) -> None:
    """Stage is configuration: a stage-3 checkpoint resumes at stage 1 and back, on 2 ranks."""
    _check_resume(name, 2, stage)


def _pipe_body(rank: int, world: int) -> dict:
    case = fx.expected()["cases"]["pipe_w2"]
    engine = fx.build_pipe_engine(fx.config_for(case, world))
    _, client = engine.load_checkpoint(str(fx.FIXTURES / "pipe_w2"))
    losses = fx.train_pipe(engine, 3, 3, rank, world)
    return {"losses": losses, "client": {k: client.get(k) for k in ("epoch", "note", "ids")}}


@pytest.mark.parametrize("world", [1, 2])
def test_deepspeed_pipeline_checkpoint_resumes(world: int) -> None:
    """A ``PipelineModule`` checkpoint (``layer_XX-model_states.pt`` plus ZeRO-1 files),
    written on 2 ranks, resumes in ds's pipeline engine on 1 and 2 ranks."""
    case = fx.expected()["cases"]["pipe_w2"]
    result = run_on_ranks(_pipe_body, world, timeout=180)[0]
    diff = max(abs(a - b) for a, b in zip(result["losses"], case["resumed_losses"]))
    assert diff <= TOLERANCE["fp32"], (result["losses"], case["resumed_losses"])
    assert result["client"] == fx.expected()["client_state"]


def _moe_body(rank: int, world: int, name: str) -> dict:
    from ds_engine._deepspeed_ckpt import load_file, read_checkpoint
    from ds_engine._deepspeed_ckpt._load import global_expert_names, trainable_names

    case = fx.expected()["cases"][name]
    engine = fx.build_moe_engine(fx.config_for(case, world), world)
    root = fx.FIXTURES / name
    _, client = engine.load_checkpoint(str(root))
    saved = dict(load_file(root / "step3" / "mp_rank_00_model_states.pt")["module"])
    for e in range(2):
        saved.update(load_file(root / "step3" / f"layer_0_expert_{e}_mp_rank_00_model_states.pt"))
    to_global = global_expert_names(engine.module)
    mismatched = [
        key
        for key, value in engine.module.state_dict().items()
        if not torch.equal(value, saved[to_global.get(key, key)])
    ]
    # The optimizer state of every parameter this rank holds (1 rank: the whole flat groups),
    # against the checkpoint's, by global expert id.
    state = read_checkpoint(root / "step3", trainable_names(engine.module))
    zero = engine.optimizer
    moments_checked, wrong_moments = 0, []
    if world == 1:
        for group, master in zip(zero.groups, zero.masters):
            inner = zero.optimizer.state[master]
            params = [p for unit in group.units for p in unit.params]
            starts = [unit.shard_start + o for unit in group.units for o in unit.offsets]
            for local, p, at in zip(group.names, params, starts):
                key = to_global.get(local, local)
                for moment in ("exp_avg", "exp_avg_sq"):
                    got = inner[moment].narrow(0, at, p.numel())
                    if not torch.equal(got, state.moments[key][moment]):
                        wrong_moments.append((key, moment))
                    moments_checked += 1
                if not torch.equal(master.narrow(0, at, p.numel()), state.fp32[key]):
                    wrong_moments.append((key, "fp32"))
            assert float(inner["step"]) == 3.0
    losses = fx.train(engine, 3, 3, rank, world, "fp32")
    return {
        "mismatched": mismatched,
        "moments_checked": moments_checked,
        "wrong_moments": wrong_moments,
        "losses": losses,
        "steps": engine.global_steps,
        "client": client.get("epoch"),
        "lr": engine.get_lr()[0],
    }


_MOE = [
    ("moe_w2", 2),
    ("moe_zero2_w2", 1),
    pytest.param("moe_w2", 1, marks=pytest.mark.slow),
    pytest.param("moe_zero2_w2", 2, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(
    ("name", "world"),
    _MOE,
    ids=["moe_w2-to-w2", "moe_zero2_w2-to-w1", "moe_w2-to-w1", "moe_zero2_w2-to-w2"],
)
def test_deepspeed_moe_checkpoint_resumes_with_its_optimizer_state(name: str, world: int) -> None:
    """An MoE checkpoint (2 experts, expert-parallel size 2; ZeRO stage 0 with
    ``expp_rank_*`` optimizer files, stage 2 with expert groups in the ZeRO files) loads its
    dense and expert weights and every parameter's fp32 master, Adam moments and step.

    On 2 ranks (expert-parallel size 2, as saved) the next three losses equal DeepSpeed's own
    resume of the checkpoint (tolerance 1e-6). On 1 rank (both experts local) each parameter's
    state (9 parameters: 5 dense, 2 experts of 2) is compared with the checkpoint's by global
    expert id; the losses are not compared
    there: the gate's capacity (``min_capacity`` 4 tokens per expert and rank) drops different
    tokens with 8 tokens on one rank than with 4 on each of two, in DeepSpeed as in ds."""
    case = fx.expected()["cases"][name]
    results = run_on_ranks(_moe_body, world, name, timeout=180)
    for result in results:
        assert result["mismatched"] == []
        assert result["steps"] == 6 and result["client"] == 7
    if world == 1:
        assert results[0]["moments_checked"] == 2 * 9 and results[0]["wrong_moments"] == []
    else:
        diff = max(abs(a - b) for a, b in zip(results[0]["losses"], case["resumed_losses"]))
        assert diff <= TOLERANCE["fp32"], (results[0]["losses"], case["resumed_losses"])


def test_reader_reassembles_partitions_into_whole_parameters() -> None:
    """The fp32 masters read from 1- and 2-rank checkpoints of every stage agree (padding
    and partitioning undone), and equal the fp32 model weights DeepSpeed saved."""
    from ds_engine._deepspeed_ckpt import read_checkpoint

    names = [n for n, _ in fx.Net().named_parameters()]
    whole = read_checkpoint(fx.FIXTURES / "zero0_fp32_w1" / "step3", names)
    for name in ("zero1_fp32_w2", "zero2_fp32_w2", "zero3_fp32_w2", "zero3_fp32_w1"):
        state = read_checkpoint(fx.FIXTURES / name / "step3", names)
        assert state.world_size == int(name[-1])
        assert sorted(state.fp32) == sorted(names)
        for key in names:
            torch.testing.assert_close(state.fp32[key], whole.fp32[key], rtol=0, atol=1e-6)
            torch.testing.assert_close(
                state.module[key].float().reshape(-1), whole.fp32[key], rtol=0, atol=1e-6
            )
            assert sorted(state.moments[key]) == ["exp_avg", "exp_avg_sq"]
        assert float(state.groups[0]["step"]) == 3.0
        assert state.engine["lr_scheduler"] == {"last_batch_iteration": 2}


def test_fp16_loss_scaler_state_is_restored() -> None:
    from ds_engine._deepspeed_ckpt import read_checkpoint

    names = [n for n, _ in fx.Net().named_parameters()]
    for name in ("zero0_fp16_w2", "zero2_fp16_w2", "zero3_fp16_w2"):
        scaler = read_checkpoint(fx.FIXTURES / name / "step3", names).loss_scaler
        assert scaler["cur_scale"] == 512.0 and scaler["dynamic"] is True, (name, scaler)


# --- safety -------------------------------------------------------------------------------------


class _Evil:
    """Unpickling this runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _EvalEvil(_Evil):
    def __reduce__(self):
        return (eval, (f"open({str(self.marker)!r}, 'w').close()",))


_POSITIONS = [
    ("zero2_fp32_w2", "mp_rank_00_model_states.pt"),
    ("zero2_fp32_w2", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ("zero1_bf16_w2", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    ("zero3_fp32_w2", "zero_pp_rank_0_mp_rank_00_model_states.pt"),
    ("zero3_fp32_w2", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ("zero0_fp16_w2", "mp_rank_00_model_states.pt"),
    ("pipe_w2", "layer_02-model_states.pt"),
    ("pipe_w2", "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    ("moe_w2", "layer_0_expert_1_mp_rank_00_model_states.pt"),
    ("moe_w2", "expp_rank_0_mp_rank_00_optim_states.pt"),
    ("moe_zero2_w2", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
]


@pytest.mark.parametrize("evil", [_Evil, _EvalEvil])
@pytest.mark.parametrize(("case", "file"), _POSITIONS)
def test_crafted_pickle_is_refused_without_running_code(
    case: str, file: str, evil: type, tmp_path: Path
) -> None:
    from ds_engine._deepspeed_ckpt import DeepSpeedCheckpointError, load_file, read_checkpoint

    root = fx.copy_case(case, tmp_path)
    target = root / "step3" / file
    marker = tmp_path / "marker"
    torch.save({"module": evil(marker), "optimizer_state_dict": {}}, target)
    names = [n for n, _ in fx.Net().named_parameters()]
    with pytest.raises(DeepSpeedCheckpointError) as info:
        read_checkpoint(root / "step3", names)
    assert "step3" in str(info.value)
    with pytest.raises(DeepSpeedCheckpointError, match=file.replace(".", r"\.")):
        load_file(target)  # the file itself, wherever it sits
    assert not marker.exists()


def _engine_load_body(rank: int, world: int, root: str) -> str:
    engine = fx.build_engine(fx.config_for(fx.expected()["cases"]["zero2_fp32_w2"], world))
    try:
        engine.load_checkpoint(root)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_engine_refuses_a_crafted_pickle_naming_the_file(tmp_path: Path) -> None:
    root = fx.copy_case("zero2_fp32_w2", tmp_path)
    marker = tmp_path / "marker"
    torch.save({"x": _Evil(marker)}, root / "step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    (root / "zero_to_fp32.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    message = run_on_ranks(_engine_load_body, 1, str(root))[0]
    assert "DeepSpeedCheckpointError" in message
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in message
    assert not marker.exists()


def test_latest_is_text_and_cannot_leave_the_directory(tmp_path: Path) -> None:
    from ds_engine._deepspeed_ckpt import DeepSpeedCheckpointError, deepspeed_tag_dir

    outside = fx.copy_case("zero1_fp32_w1", tmp_path)
    load_dir = tmp_path / "run"
    load_dir.mkdir()
    (load_dir / "latest").write_text("../zero1_fp32_w1/step3")
    with pytest.raises(DeepSpeedCheckpointError, match="no path separators"):
        deepspeed_tag_dir(load_dir, None)
    marker = tmp_path / "marker"
    (outside / "latest").write_bytes(
        __import__("pickle").dumps(_Evil(marker))  # pickle bytes in 'latest': just a bad tag
    )
    assert deepspeed_tag_dir(outside, None) is None
    assert not marker.exists()
    assert deepspeed_tag_dir(outside, "step3") == outside / "step3"


def test_missing_or_inconsistent_files_are_named(tmp_path: Path) -> None:
    from ds_engine._deepspeed_ckpt import DeepSpeedCheckpointError, read_checkpoint

    names = [n for n, _ in fx.Net().named_parameters()]
    root = fx.copy_case("zero2_fp32_w2", tmp_path)
    (root / "step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(DeepSpeedCheckpointError, match=r"dp_world_size 2.*1 ZeRO optimizer"):
        read_checkpoint(root / "step3", names)
    root = fx.copy_case("zero3_fp32_w2", tmp_path / "b")
    (root / "step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"truncated")
    with pytest.raises(DeepSpeedCheckpointError, match="zero_pp_rank_0_mp_rank_00_optim_states"):
        read_checkpoint(root / "step3", names)


# --- DeepSpeed -> ds -> DeepSpeed ---------------------------------------------------------------

_needs_deepspeed = pytest.mark.skipif(
    not fx.DSREF_PYTHON.exists(), reason=f"real DeepSpeed is not installed at {fx.DSREF_PYTHON}"
)


def _ds_leg_body(rank: int, world: int, name: str, out: str, target_world: int) -> list[float]:
    from ds_engine.deepspeed_checkpoint import save_deepspeed_checkpoint

    case = fx.expected()["cases"][name]
    engine = fx.build_engine(fx.config_for(case, world))
    engine.load_checkpoint(str(fx.FIXTURES / name))
    losses = fx.train(engine, 3, 1, rank, world, case["dtype"])
    save_deepspeed_checkpoint(
        engine, out, client_state={"epoch": 8, "note": "from ds"}, world_size=target_world
    )
    return losses


def _deepspeed_resume(load: Path, world: int, stage: int, dtype: str) -> dict:
    args = [str(load), "--world", str(world), "--stage", str(stage), "--dtype", dtype]
    return fx.run_deepspeed(fx.GENERATOR, "resume", *args)


# Every stage 1-3 and dtype with a fixture, both ways (fp16 fixtures exist for 2 ranks only).
_ROUND_TRIPS = [
    (f"zero{s}_{d}_w{w}", 3 - w)
    for s in (1, 2, 3)
    for d in ("fp32", "bf16", "fp16")
    for w in (1, 2)
    if (d, w) != ("fp16", 1)
]


@_needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "ds_world"), _ROUND_TRIPS, ids=[f"{n}-ds_w{w}" for n, w in _ROUND_TRIPS]
)
def test_round_trip_deepspeed_ds_deepspeed(name: str, ds_world: int, tmp_path: Path) -> None:
    """DeepSpeed (w ranks) -> ds (3 - w ranks, one step) -> DeepSpeed (w ranks, two steps):
    all three steps continue DeepSpeed's own trajectory (see [Note: DeepSpeed resume
    tolerance])."""
    case = fx.expected()["cases"][name]
    out = tmp_path / "for_deepspeed"
    ds_losses = run_on_ranks(_ds_leg_body, ds_world, name, str(out), case["world_size"])[0]
    result = _deepspeed_resume(out, case["world_size"], case["stage"], case["dtype"])
    assert result["first_step"] == 4
    assert result["client_state"] == {"epoch": 8, "note": "from ds"}
    tolerance = _tolerance(case["dtype"], case["stage"])
    losses = ds_losses + result["losses"]
    diff = max(abs(a - b) for a, b in zip(losses, case["resumed_losses"]))
    assert diff <= tolerance, (losses, case["resumed_losses"], diff)


def test_only_deepspeed_layouts_are_taken_for_deepspeed(tmp_path: Path) -> None:
    """ds's own checkpoints (engine, pipeline) keep going to ds's loader."""
    from ds_engine._deepspeed_ckpt import is_deepspeed_checkpoint

    for name in sorted(fx.expected()["cases"]):
        assert is_deepspeed_checkpoint(fx.FIXTURES / name / "step3"), name
    engine_dir = tmp_path / "engine"
    (engine_dir / "zero").mkdir(parents=True)
    for file in ("mp_rank_00_model_states.pt", "rng_state_rank00000.pt"):
        (engine_dir / file).write_bytes(b"")
    pipe_dir = tmp_path / "pipe"
    pipe_dir.mkdir()
    for file in ("layer_00-model_states.pt", "pp_rank_00_dp_rank_00_states.pt"):
        (pipe_dir / file).write_bytes(b"")
    assert not is_deepspeed_checkpoint(engine_dir)
    assert not is_deepspeed_checkpoint(pipe_dir)
    assert not is_deepspeed_checkpoint(tmp_path / "absent")
