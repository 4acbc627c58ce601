"""ds writes DeepSpeed's checkpoint layout (``save_deepspeed_checkpoint``, ``ds-to-deepspeed``)
and real DeepSpeed 0.19.8 resumes it.

[Note: ds -> DeepSpeed resume tolerance]
ds trains the fixtures' model (``tools/compat/make_deepspeed_checkpoints.py``: same layers,
data, config and initial seed) for 3 steps on ``w`` ranks, writes DeepSpeed's layout for ``w'``
ranks and keeps training; real DeepSpeed (``tools/compat/deepspeed_resume.py``) loads the files
on ``w'`` ranks and trains the same next steps. Each loss is the mean over the whole global batch,
so the two runs must agree within ``TOLERANCE`` (absolute): fp32 1e-6 (the rounding of another
reduction order), bf16 1e-3, fp16 5e-3, and 2e-2 for fp16 at stage 0 (DeepSpeed's stage-0 fp16
optimizer steps differently from ds's, see test_deepspeed_checkpoints.py's [Note: DeepSpeed
resume tolerance]). The DeepSpeed legs need DeepSpeed at ``/tmp/dsref`` and skip without it (no
nox session installs real DeepSpeed). The default tier checks, without DeepSpeed, that the files
ds writes have exactly the structure of the ones DeepSpeed wrote for the same case (keys, types,
shapes, dtypes) and that ds's own reader resumes them on the ds trajectory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
import _deepspeed_fixtures as fx

RESUMER = fx.GENERATOR.with_name("deepspeed_resume.py")
TOLERANCE = {"fp32": 1e-6, "bf16": 1e-3, "fp16": 5e-3}
FP16_STAGE0_TOLERANCE = 2e-2
CLIENT = {"epoch": 8, "note": "from ds"}

_needs_deepspeed = pytest.mark.skipif(
    not fx.DSREF_PYTHON.exists(), reason=f"real DeepSpeed is not installed at {fx.DSREF_PYTHON}"
)


def _tolerance(dtype: str, stage: int) -> float:
    return FP16_STAGE0_TOLERANCE if (dtype, stage) == ("fp16", 0) else TOLERANCE[dtype]


def _groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """The two param groups ``deepspeed_resume.py --model groups`` builds (weights, biases)."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": 0.01},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
    ]


def _config(stage: int, dtype: str, world: int) -> dict[str, Any]:
    case = {"config": fx._maker.config(stage, dtype, world)}
    return fx.config_for(case, world)


def _engine(model: str, stage: int, dtype: str, world: int, seed: int = 0):
    """``model``: one of ``deepspeed_resume.py``'s models (``pipe2``: two stages, one
    data-parallel rank, so the config is the one-rank one)."""
    import ds_engine

    cfg = _config(stage, dtype, 1 if model == "pipe2" else world)
    if model in ("pipe", "pipe2"):
        return fx.build_pipe_engine(cfg, seed=seed, num_stages=2 if model == "pipe2" else 1)
    if model.startswith("moe"):
        ep_size = 1 if model == "moe-ep1" else world
        return fx.build_moe_engine(
            cfg, world, seed=seed, ep_size=ep_size, multi=model == "moe-multi"
        )
    torch.manual_seed(seed)
    net = fx.Net()
    params = _groups(net) if model == "groups" else net.parameters()
    engine, *_ = ds_engine.initialize(model=net, model_parameters=params, config=cfg)
    return engine


def _train(engine, model: str, first: int, count: int, rank: int, world: int, dtype: str):
    if model in ("pipe", "pipe2"):
        data = (0, 1) if model == "pipe2" else None
        return fx.train_pipe(engine, first, count, rank, world, data)
    return fx.train(engine, first, count, rank, world, dtype)


def _write_body(
    rank: int,
    world: int,
    model: str,
    stage: int,
    dtype: str,
    out: str,
    target_world: int,
    target_stage: int,
) -> list[float]:
    """ds trains 3 steps, writes DeepSpeed's layout for ``target_world`` ranks at
    ``target_stage``, and returns its next 2 losses."""
    from ds_engine.deepspeed_checkpoint import save_deepspeed_checkpoint

    engine = _engine(model, stage, dtype, world)
    _train(engine, model, 0, 3, rank, world, dtype)
    # world_size is DeepSpeed's data-parallel size: its ranks over the two pipeline stages
    dp_world = target_world // 2 if model == "pipe2" else target_world
    save_deepspeed_checkpoint(
        engine, out, client_state=CLIENT, world_size=dp_world, stage=target_stage
    )
    return _train(engine, model, 3, 2, rank, world, dtype)


def deepspeed_resume(load: Path, model: str, world: int, stage: int, dtype: str) -> dict:
    """Real DeepSpeed loads ``load`` on ``world`` ranks and trains 2 steps (its RESULT)."""
    args = [str(load), "--model", model, "--world", str(world), "--stage", str(stage)]
    return fx.run_deepspeed(RESUMER, *args, "--dtype", dtype, "--steps", "2")


def check_deepspeed_resumes(
    tmp_path: Path,
    model: str,
    dtype: str,
    *,
    ds: tuple[int, int],
    deepspeed: tuple[int, int],
) -> dict[str, Any]:
    """ds on ``ds = (world, stage)`` writes for DeepSpeed on ``deepspeed = (world, stage)``;
    DeepSpeed's next two losses equal ds's (see [Note: ds -> DeepSpeed resume tolerance])."""
    out = tmp_path / "for_deepspeed"
    (w, s), (tw, ts) = ds, deepspeed
    continued = run_on_ranks(_write_body, w, model, s, dtype, str(out), tw, ts, timeout=240)[0]
    result = deepspeed_resume(out, model, tw, ts, dtype)
    diff = max(abs(a - b) for a, b in zip(continued, result["losses"]))
    assert result["first_step"] == 3
    assert result["client_state"] == CLIENT
    assert diff <= _tolerance(dtype, ts), (continued, result["losses"], diff)
    return {"ds": continued, "deepspeed": result["losses"], "diff": diff}


# --- DeepSpeed resumes what ds wrote (needs /tmp/dsref) -------------------------------------

# Every stage, 1 -> 2 and 2 -> 1 ranks (ds's world -> DeepSpeed's).
_RESUME = [(s, w) for s in (0, 1, 2, 3) for w in (1, 2)]


@_needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize(("stage", "ds_world"), _RESUME, ids=[f"z{s}-w{w}" for s, w in _RESUME])
def test_deepspeed_resumes_what_ds_wrote(stage: int, ds_world: int, tmp_path: Path) -> None:
    check_deepspeed_resumes(
        tmp_path, "net", "fp32", ds=(ds_world, stage), deepspeed=(3 - ds_world, stage)
    )


_VARIANTS = [
    ("groups", "fp32", (2, 0), (1, 0)),
    ("groups", "fp32", (1, 2), (2, 2)),
    ("groups", "bf16", (2, 3), (1, 3)),
    ("net", "bf16", (2, 0), (1, 0)),
    ("net", "fp16", (1, 0), (2, 0)),
    ("net", "bf16", (2, 1), (1, 1)),
    ("net", "fp32", (2, 3), (1, 1)),  # another stage as well as another world size
    ("pipe", "fp32", (2, 1), (1, 1)),
    ("pipe", "fp32", (1, 0), (2, 0)),
    ("moe", "fp32", (2, 0), (2, 0)),
    # MoE at ZeRO 1-2 (experts partitioned over their expert-data-parallel group), another
    # stage than ds ran, ep_size 1 and two layers of different ep_size (see
    # [Note: DeepSpeed's MoE checkpoint]); the world stays 2: a rank's expert capacity depends
    # on its share of the batch, so another world size routes tokens differently.
    ("moe", "fp32", (2, 2), (2, 2)),
    ("moe", "fp32", (2, 1), (2, 1)),
    ("moe", "fp32", (2, 0), (2, 2)),
    ("moe-ep1", "fp32", (2, 2), (2, 1)),
    ("moe-multi", "fp32", (2, 0), (2, 0)),
    ("moe-multi", "fp32", (2, 2), (2, 2)),
    ("moe-multi", "fp32", (2, 1), (2, 2)),
    ("moe", "fp32", (2, 3), (2, 2)),  # ds's ZeRO-3 MoE (DeepSpeed runs MoE at 0-2 only)
    ("moe-multi", "fp32", (2, 3), (2, 1)),
    ("moe", "bf16", (2, 2), (2, 2)),
    ("moe-multi", "bf16", (2, 1), (2, 1)),
    # two pipeline stages on two ranks (one data-parallel rank each)
    ("pipe2", "fp32", (2, 1), (2, 1)),
    ("pipe2", "fp32", (2, 0), (2, 0)),
]


@_needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "dtype", "ds", "deepspeed"),
    _VARIANTS,
    ids=[f"{m}-{d}-z{a[1]}w{a[0]}-to-z{b[1]}w{b[0]}" for m, d, a, b in _VARIANTS],
)
def test_deepspeed_resumes_groups_dtypes_pipeline_moe(
    model: str, dtype: str, ds: tuple[int, int], deepspeed: tuple[int, int], tmp_path: Path
) -> None:
    check_deepspeed_resumes(tmp_path, model, dtype, ds=ds, deepspeed=deepspeed)


# --- the files have DeepSpeed's structure; the CLI writes what the engine writes ---------------

# (fixture case DeepSpeed wrote, model): ds writes the same case on 2 ranks for 2 ranks.
_STRUCTURE = [
    ("zero0_fp32_w2", "net"),
    ("zero0_bf16_w2", "net"),
    ("zero0_fp16_w2", "net"),
    ("zero1_fp32_w2", "net"),
    ("zero2_bf16_w2", "net"),
    ("zero3_fp16_w2", "net"),
    ("pipe_w2", "pipe"),
    ("moe_w2", "moe"),
    ("moe_zero2_w2", "moe"),
]

# (model, ds stage): ds saves its own checkpoint and writes DeepSpeed's layout from the engine;
# ``ds-to-deepspeed`` must write the same files from the saved checkpoint.
_CLI_LAYOUTS = [("pipe2", 1), ("moe-multi", 2), ("moe", 0)]


def _structure_body(rank: int, world: int, out: str) -> None:
    """ds writes every ``_STRUCTURE`` case (and a ds checkpoint of the two-group model)."""
    from ds_engine.deepspeed_checkpoint import save_deepspeed_checkpoint

    for name, model in _STRUCTURE:
        case = fx.expected()["cases"][name]
        stage, dtype = case["stage"], case["dtype"]
        engine = _engine(model, stage, dtype, world)
        _train(engine, model, 0, 3, rank, world, dtype)
        save_deepspeed_checkpoint(engine, Path(out) / name, tag="step3", client_state=CLIENT)
    for model, stage in _CLI_LAYOUTS:
        engine = _engine(model, stage, "fp32", world)
        _train(engine, model, 0, 3, rank, world, "fp32")
        engine.save_checkpoint(str(Path(out) / f"native_{model}"), client_state=CLIENT)
        save_deepspeed_checkpoint(engine, Path(out) / f"engine_{model}", client_state=CLIENT)
    engine = _engine("groups", 1, "fp32", world)
    _train(engine, "groups", 0, 3, rank, world, "fp32")
    engine.save_checkpoint(str(Path(out) / "ds_native"), client_state=CLIENT)
    save_deepspeed_checkpoint(
        engine, Path(out) / "groups_engine", client_state=CLIENT, world_size=1, stage=2
    )


def _shape_of(value: Any, path: str) -> Any:
    """What DeepSpeed's loaders depend on: keys, types, tensor shapes and dtypes."""
    if torch.is_tensor(value):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, dict):
        # ds's param groups keep the scheduler's initial_lr (DeepSpeed's loader ignores it)
        items = {k: v for k, v in value.items() if k != "initial_lr"}
        return {k: _shape_of(v, f"{path}[{k!r}]") for k, v in items.items()}
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_shape_of(v, f"{path}[{i}]") for i, v in enumerate(value)])
    if hasattr(value, "__dict__"):  # DeepSpeed's loss scaler and fragment_address
        return (type(value).__name__, sorted(vars(value)))
    return type(value).__name__


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("written")
    run_on_ranks(_structure_body, 2, str(out), timeout=300)
    return out


@pytest.mark.parametrize(("name", "model"), _STRUCTURE, ids=[n for n, _ in _STRUCTURE])
def test_written_files_have_deepspeeds_structure(written: Path, name: str, model: str) -> None:
    """Every file DeepSpeed wrote for the case, ds writes too, with the same keys, types, tensor
    shapes and dtypes (values differ only by training arithmetic; ``ds_config`` and the client
    state are the writer's)."""
    from ds_engine._deepspeed_ckpt import load_file

    theirs, ours = fx.FIXTURES / name / "step3", written / name / "step3"
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    assert (written / name / "latest").read_text() == "step3"
    for file in sorted(theirs.iterdir()):
        a, b = load_file(file), load_file(ours / file.name)
        for state in (a, b):
            if "ds_config" in state:
                state["ds_config"] = {}
            for key in ("epoch", "note", "ids"):
                state.pop(key, None)
            if isinstance(state.get("optimizer_state_dict"), dict):
                state["optimizer_state_dict"].pop("ds_config", None)
        assert _shape_of(b, file.name) == _shape_of(a, file.name), file.name


def _tensors(folder: Path) -> dict[str, Any]:
    from ds_engine._deepspeed_ckpt import load_file

    return {p.name: load_file(p) for p in sorted(folder.iterdir())}


def _assert_same(a: Any, b: Any, where: str) -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), (where, sorted(map(str, a)), sorted(map(str, b)))
        for key in a:
            _assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__"):
        assert vars(a) == vars(b), where
    else:
        assert a == b, (where, a, b)


def test_cli_writes_what_the_engine_writes(written: Path, tmp_path: Path) -> None:
    """``ds-to-deepspeed`` (run as docs/migration.md shows) on a ds checkpoint of a two-group
    model gives the same files, tensor for tensor, as ``save_deepspeed_checkpoint`` on the
    engine that saved it (client state included)."""
    out = tmp_path / "converted"
    command = [
        str(Path(sys.executable).with_name("ds-to-deepspeed")),
        str(written / "ds_native"),
        str(out),
        "--world-size",
        "1",
        "--stage",
        "2",
        "--param-group",
        r"weight$",
        "--param-group",
        r"bias$",
        "--config",
        str(_config_file(tmp_path, 1, "fp32", 2)),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(out / "global_step3")
    assert (out / "latest").read_text() == "global_step3"
    ours, engines = (
        _tensors(out / "global_step3"),
        _tensors(written / "groups_engine" / "global_step3"),
    )
    for state in (*ours.values(), *engines.values()):
        state.pop("ds_config", None)
        if isinstance(state.get("optimizer_state_dict"), dict):
            state["optimizer_state_dict"].pop("ds_config", None)
    _assert_same(ours, engines, "files")
    assert ours["mp_rank_00_model_states.pt"]["epoch"] == CLIENT["epoch"]


def _cli(*args: str) -> None:
    """``ds-to-deepspeed <args>``, in this process (the console script's ``main``)."""
    from ds_engine.checkpoint.ds_to_deepspeed import main

    assert main(list(args)) == 0


@pytest.mark.parametrize(("model", "stage"), _CLI_LAYOUTS, ids=[m for m, _ in _CLI_LAYOUTS])
def test_cli_converts_pipeline_and_moe(
    written: Path, tmp_path: Path, model: str, stage: int
) -> None:
    """``ds-to-deepspeed`` on a ds checkpoint of a two-stage pipeline or an MoE model (two
    layers of ep_size 1 and 2 at ZeRO-2; ep_size 2 at ZeRO-0) writes, tensor for tensor, the
    files ``save_deepspeed_checkpoint`` wrote from the engine that saved it."""
    out = tmp_path / "converted"
    world = 1 if model == "pipe2" else 2
    config = _config_file(tmp_path, world, "fp32", stage)
    _cli(str(written / f"native_{model}"), str(out), "--config", str(config))
    ours = _tensors(out / "global_step3")
    engines = _tensors(written / f"engine_{model}" / "global_step3")
    for state in (*ours.values(), *engines.values()):
        if isinstance(state, dict):
            state.pop("ds_config", None)
            if isinstance(state.get("optimizer_state_dict"), dict):
                state["optimizer_state_dict"].pop("ds_config", None)
    _assert_same(ours, engines, "files")


def _config_file(tmp_path: Path, world: int, dtype: str, stage: int) -> Path:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(_config(stage, dtype, world)))
    return path


def test_cli_refuses_what_it_cannot_convert(written: Path, tmp_path: Path) -> None:
    from ds_engine.checkpoint.ds_to_deepspeed import convert_to_deepspeed
    from ds_engine.deepspeed_checkpoint import DeepSpeedCheckpointError

    with pytest.raises(DeepSpeedCheckpointError, match=r"2 param groups.*--param-group"):
        convert_to_deepspeed(written / "ds_native", tmp_path / "a")
    with pytest.raises(DeepSpeedCheckpointError, match=r"'fc1\.bias' matches no --param-group"):
        convert_to_deepspeed(written / "ds_native", tmp_path / "b", param_groups=["weight$", "x"])
    with pytest.raises(DeepSpeedCheckpointError, match=r"no zero/manifest\.json"):
        convert_to_deepspeed(fx.FIXTURES / "zero1_fp32_w2", tmp_path / "c")
    with pytest.raises(
        DeepSpeedCheckpointError, match=r"pipeline engine runs at ZeRO stage 0 or 1"
    ):
        convert_to_deepspeed(written / "native_pipe2", tmp_path / "d", stage=2)
    with pytest.raises(DeepSpeedCheckpointError, match=r"does not run MoE models at ZeRO stage 3"):
        convert_to_deepspeed(written / "native_moe", tmp_path / "e", stage=3)
    with pytest.raises(
        DeepSpeedCheckpointError, match=r"not a multiple of the MoE layers' ep_size"
    ):
        convert_to_deepspeed(written / "native_moe", tmp_path / "f", world_size=3)
    # a ds ZeRO-3 MoE checkpoint (manifest format): which layer has which ep_size is not recorded
    z3 = tmp_path / "z3" / "step3"
    (z3 / "zero").mkdir(parents=True)
    for file in (fx.FIXTURES / "moe_w2" / "step3").glob("*model_states.pt"):
        (z3 / file.name).write_bytes(file.read_bytes())
    (z3 / "zero" / "manifest.json").write_text("{}")
    with pytest.raises(DeepSpeedCheckpointError, match=r"saved at ZeRO stage 3.*save_deepspeed"):
        convert_to_deepspeed(z3, tmp_path / "g")


def _native_body(rank: int, world: int, model: str, stage: int, dtype: str, out: str):
    """ds trains 3 steps, saves its own checkpoint, and returns its next 2 losses."""
    engine = _engine(model, stage, dtype, world)
    _train(engine, model, 0, 3, rank, world, dtype)
    engine.save_checkpoint(out, client_state=CLIENT)
    return _train(engine, model, 3, 2, rank, world, dtype)


@_needs_deepspeed
@pytest.mark.slow
def test_deepspeed_resumes_what_the_cli_converted(tmp_path: Path) -> None:
    """A ds checkpoint of the two-group model (2 ranks, ZeRO-3, bf16), converted by
    ``ds-to-deepspeed`` for 1 rank at ZeRO-1, resumes in DeepSpeed on ds's trajectory."""
    saved, out = tmp_path / "ds", tmp_path / "for_deepspeed"
    continued = run_on_ranks(_native_body, 2, "groups", 3, "bf16", str(saved), timeout=240)[0]
    command = [str(Path(sys.executable).with_name("ds-to-deepspeed")), str(saved), str(out)]
    command += ["--world-size", "1", "--stage", "1"]
    command += ["--param-group", r"weight$", "--param-group", r"bias$"]
    command += ["--config", str(_config_file(tmp_path, 1, "bf16", 1))]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = deepspeed_resume(out, "groups", 1, 1, "bf16")
    assert result["first_step"] == 3 and result["client_state"] == CLIENT
    diff = max(abs(a - b) for a, b in zip(continued, result["losses"]))
    assert diff <= TOLERANCE["bf16"], (continued, result["losses"], diff)


_CLI_RESUME = [("pipe2", 1), ("moe-multi", 2), ("moe", 1)]


@_needs_deepspeed
@pytest.mark.slow
@pytest.mark.parametrize(("model", "stage"), _CLI_RESUME, ids=[m for m, _ in _CLI_RESUME])
def test_deepspeed_resumes_cli_converted_pipeline_and_moe(
    model: str, stage: int, tmp_path: Path
) -> None:
    """A ds checkpoint of a two-stage pipeline (ZeRO-1) or an MoE model (two layers of ep_size
    1 and 2 at ZeRO-2; ep_size 2 at ZeRO-1) on 2 ranks, converted by ``ds-to-deepspeed``,
    resumes in DeepSpeed on 2 ranks on ds's trajectory (fp32: within 1e-6)."""
    saved, out = tmp_path / "ds", tmp_path / "for_deepspeed"
    continued = run_on_ranks(_native_body, 2, model, stage, "fp32", str(saved), timeout=240)[0]
    world = 1 if model == "pipe2" else 2
    config = _config_file(tmp_path, world, "fp32", stage)
    _cli(str(saved), str(out), "--config", str(config))
    result = deepspeed_resume(out, model, 2, stage, "fp32")
    assert result["first_step"] == 3 and result["client_state"] == CLIENT
    diff = max(abs(a - b) for a, b in zip(continued, result["losses"]))
    assert diff <= TOLERANCE["fp32"], (continued, result["losses"], diff)
