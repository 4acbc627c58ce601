"""Universal checkpoints: ``ds-to-universal`` writes DeepSpeed's layout from a ds checkpoint, and
an engine with ``checkpoint: {load_universal: true}`` loads such a folder at another world size
and ZeRO stage and continues the loss trajectory of the run that saved it (relative tolerance
1e-5: only the order of the data-parallel reductions differs). Folders real DeepSpeed 0.19.8's
``ds_to_universal`` wrote (``fixtures/universal_0.19.8``, made by
``tools/compat/make_universal_checkpoint.py``) load into ds and continue DeepSpeed's own
trajectory."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
import _deepspeed_fixtures as fx

FIXTURES = Path(__file__).parent / "fixtures" / "universal_0.19.8"
GLOBAL, STEPS, RTOL = 8, 3, 1e-5


class Net(torch.nn.Module):
    """The model of ``tools/compat/make_universal_checkpoint.py`` (its forward is the loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(6, 10), torch.nn.Linear(10, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.fc2(torch.tanh(self.fc1(x))) - y) ** 2).mean()


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def _batch(step: int, rank: int, world: int):
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GLOBAL, 6, generator=gen), torch.randn(GLOBAL, 3, generator=gen)
    rows = GLOBAL // world
    return x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]


def _engine(module, stage: int, world: int, universal: bool):
    import ds_engine as deepspeed

    config = {
        "train_micro_batch_size_per_gpu": GLOBAL // world,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": stage},
        "checkpoint": {"load_universal": universal},
        "steps_per_print": 1000,
    }
    engine, *_ = deepspeed.initialize(
        model=module, model_parameters=module.parameters(), config=config
    )
    return engine


def _steps(engine, first: int, count: int, rank: int, world: int, forward) -> list[float]:
    import torch.distributed as dist

    losses = []
    for step in range(first, first + count):
        x, y = (t.to(engine.device) for t in _batch(step, rank, world))
        loss = forward(engine, x, y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def _mse(engine, x, y):
    return ((engine(x) - y) ** 2).mean()


def _train_save_continue(rank: int, world: int, stage: int, save_dir: str) -> list[float]:
    engine = _engine(_net(), stage, world, universal=False)
    _steps(engine, 0, STEPS, rank, world, _mse)
    engine.save_checkpoint(save_dir, tag="step3")
    return _steps(engine, STEPS, STEPS, rank, world, _mse)


def _resume(rank: int, world: int, stage: int, load_dir: str, fixture: bool) -> list[float]:
    torch.manual_seed(7)
    if fixture:  # DeepSpeed's Net: the model computes its own loss
        engine = _engine(Net(), stage, world, universal=True)
        path, _ = engine.load_checkpoint(load_dir)
        return _steps(engine, STEPS, STEPS, rank, world, lambda e, x, y: e(x, y))
    module = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    engine = _engine(module, stage, world, universal=True)
    path, _ = engine.load_checkpoint(load_dir)
    assert path.endswith("step3_universal")
    assert engine.global_steps == STEPS
    return _steps(engine, STEPS, STEPS, rank, world, _mse)


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        pytest.param((2, 2), (1, 3), marks=pytest.mark.slow),  # 3 multi-rank runs: ~60-100 s
        pytest.param((1, 1), (2, 2), marks=pytest.mark.slow),
    ],
    ids=["w2z2-to-w1z3", "w1z1-to-w2z2"],
)
def test_ds_checkpoint_to_universal_and_back(tmp_path: Path, saved, loaded) -> None:
    from ds_engine.checkpoint.ds_to_universal import main

    (world, stage), (new_world, new_stage) = saved, loaded
    save_dir = tmp_path / "ckpt"
    continued = run_on_ranks(_train_save_continue, world, stage, str(save_dir), timeout=300)[0]
    out = save_dir / "step3_universal"
    with pytest.raises(ValueError, match="--inject_missing_state"):
        main(["--input_folder", str(save_dir / "step3"), "--output_folder", str(out)])
    args = ["--input_folder", str(save_dir / "step3"), "--output_folder", str(out)]
    assert main([*args, "--inject_missing_state", "--keep_temp_folder"]) == 0
    assert (save_dir / "latest_universal").read_text() == "step3_universal"
    assert (out / "tmp").is_dir()  # the extract phase's fragments, kept on request
    assert (out / "mp_rank_00_model_states.pt").is_file()
    names = {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert {p.name for p in (out / "zero").iterdir()} == names | {"optimizer_state.pt"}
    for name in names:
        files = {p.name for p in (out / "zero" / name).iterdir()}
        assert files == {"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt", "step.pt"}
    fp32 = torch.load(out / "zero" / "2.weight" / "fp32.pt", weights_only=True)
    assert fp32["param"].shape == (3, 10) and fp32["cat_dim"] == 0
    shutil.rmtree(out / "tmp")
    resumed = run_on_ranks(_resume, new_world, new_stage, str(save_dir), False, timeout=300)[0]
    torch.testing.assert_close(resumed, continued, rtol=RTOL, atol=0)


@pytest.mark.parametrize("case", ["zero2_w2", "zero3_w2"])
def test_deepspeed_universal_folder_continues_deepspeeds_losses(tmp_path: Path, case: str) -> None:
    """zero2_w2: equal to the losses DeepSpeed computed resuming the folder itself and to the
    uninterrupted run's; zero3_w2 (DeepSpeed's stage-3 output: flat state files, zero_pp_rank
    model files; DeepSpeed 0.19.8 could not resume it here) to the uninterrupted run's."""
    expected = json.loads((FIXTURES / "expected.json").read_text())
    want = expected["cases"][case]
    shutil.copytree(FIXTURES / case, tmp_path / case)
    got = run_on_ranks(_resume, 1, 1, str(tmp_path / case), True, timeout=300)[0]
    if "resumed" in want:
        torch.testing.assert_close(got, want["resumed"], rtol=RTOL, atol=0)
    torch.testing.assert_close(got, want["continued"], rtol=RTOL, atol=0)


# --- ds -> universal -> DeepSpeed ---------------------------------------------------------------

DSREF_PYTHON = fx.DSREF_PYTHON
UNIVERSAL_SCRIPT = Path(__file__).parents[3] / "tools" / "compat" / "make_universal_checkpoint.py"


def _train_net_save_continue(rank: int, world: int, stage: int, save_dir: str) -> list[float]:
    """The fixture script's ``Net`` (names ``fc1.*``, ``fc2.*``, as DeepSpeed's model has)."""
    torch.manual_seed(0)
    engine = _engine(Net(), stage, world, universal=False)
    forward = lambda e, x, y: e(x, y)  # noqa: E731
    _steps(engine, 0, STEPS, rank, world, forward)
    engine.save_checkpoint(save_dir, tag="step3")
    return _steps(engine, STEPS, STEPS, rank, world, forward)


def deepspeed_resumes_universal(load_dir: Path, world: int, stage: int) -> dict:
    """Real DeepSpeed loads ``load_dir``'s universal folder (``checkpoint.load_universal``) on
    ``world`` ranks at ``stage`` and trains 3 steps: ``{"resumed": losses, "first_step": ...}``."""
    args = [str(load_dir), "--world", str(world), "--stage", str(stage)]
    return fx.run_deepspeed(UNIVERSAL_SCRIPT, "resume", *args)


def make_ds_universal(tmp_path: Path, world: int, stage: int) -> tuple[Path, list[float]]:
    """ds trains 3 steps on ``world`` ranks at ``stage``, saves, and ``ds-to-universal``
    converts the checkpoint: the save dir and the uninterrupted run's next 3 losses."""
    from ds_engine.checkpoint.ds_to_universal import main

    save_dir = tmp_path / "ckpt"
    continued = run_on_ranks(_train_net_save_continue, world, stage, str(save_dir), timeout=300)
    args = ["--input_folder", str(save_dir / "step3"), "--output_folder"]
    assert main([*args, str(save_dir / "step3_universal"), "--inject_missing_state"]) == 0
    return save_dir, continued[0]


_TO_DEEPSPEED = [((2, 2), (1, 1)), ((1, 1), (2, 2)), ((2, 3), (1, 2)), ((1, 3), (2, 1))]


@pytest.mark.slow
@pytest.mark.skipif(not DSREF_PYTHON.exists(), reason=f"no DeepSpeed at {DSREF_PYTHON}")
@pytest.mark.parametrize(
    ("saved", "loaded"),
    _TO_DEEPSPEED,
    ids=[f"w{a}z{b}-to-w{c}z{d}" for (a, b), (c, d) in _TO_DEEPSPEED],
)
def test_ds_universal_folder_resumes_in_deepspeed(tmp_path: Path, saved, loaded) -> None:
    """ds (``saved`` = world size, stage) -> ``ds-to-universal`` -> real DeepSpeed 0.19.8 with
    ``checkpoint: {load_universal: true}`` (``loaded``): DeepSpeed's next 3 losses equal the
    uninterrupted ds run's (relative 1e-5)."""
    save_dir, continued = make_ds_universal(tmp_path, *saved)
    result = deepspeed_resumes_universal(save_dir, *loaded)
    assert result["first_step"] == STEPS
    torch.testing.assert_close(result["resumed"], continued, rtol=RTOL, atol=0)
