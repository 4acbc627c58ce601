"""``consolidate`` / ``ds-zero-to-fp32``: a sharded checkpoint of any stage becomes one fp32 state
dict that plain ``load_state_dict`` takes, equal to single-process training's parameters."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _ds_zero_testing import (
    Recipe,
    adam,
    global_batches,
    make_model,
    micro_batches,
    parameter_error,
    reference_train,
)

STEPS, ROWS = 3, 8


def _train_and_save(rank: int, world_size: int, *, path: str, stage: int) -> None:
    from ds_zero import Stage3Optimizer, ZeroConfig, ZeroOptimizer, save_sharded_checkpoint

    model = make_model(torch.float32)
    section = {"stage": stage, "reduce_bucket_size": 2000}
    if stage == 3:
        section["stage3_param_persistence_threshold"] = 64
    wrapper = Stage3Optimizer if stage == 3 else ZeroOptimizer
    zero = wrapper(model, adam(list(model.parameters())), ZeroConfig.from_dict(section))
    for batch in global_batches(STEPS, ROWS):
        (micro,) = micro_batches(batch, rank, world_size, 1)
        zero.backward(model(micro))
        zero.step()
    save_sharded_checkpoint(path, zero)


def _reference() -> dict[str, torch.Tensor]:
    return reference_train(make_model(torch.float32), global_batches(STEPS, ROWS), Recipe(adam))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Stage 2 and stage 3 checkpoints, each saved on 2 ranks after ``STEPS`` steps."""
    root = tmp_path_factory.mktemp("consolidate")
    out = {}
    for stage in (2, 3):
        out[stage] = root / f"stage{stage}"
        run_on_ranks(_train_and_save, 2, path=str(out[stage]), stage=stage, timeout=300)
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_consolidated_state_dict_equals_single_process_training(
    checkpoints: dict[int, Path], tmp_path: Path, stage: int
) -> None:
    from ds_zero import consolidate

    output = tmp_path / "fp32.pt"
    state = consolidate(checkpoints[stage], output, progress=False)
    assert all(t.dtype == torch.float32 for t in state.values())
    assert state["head.weight"] is state["tok.weight"]  # tied, as in the model
    model = make_model(torch.float32, seed=99)
    model.load_state_dict(state)  # strict: every key of the model is there
    assert parameter_error(model, _reference()) <= 1e-5
    written = torch.load(output, weights_only=True)
    assert written.keys() == state.keys()
    assert all(torch.equal(written[k], state[k]) for k in state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fp32.pt"]  # no temporary left


def test_cli_writes_a_loadable_file(checkpoints: dict[int, Path], tmp_path: Path) -> None:
    from ds_zero._consolidate import main

    output = tmp_path / "pytorch_model.bin"
    assert main([str(checkpoints[2]), str(output), "--quiet"]) == 0
    model = make_model(torch.float32, seed=99)
    model.load_state_dict(torch.load(output, weights_only=True))
    assert parameter_error(model, _reference()) <= 1e-5


def test_console_script_is_installed_and_runs(checkpoints: dict[int, Path], tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "ds-zero-to-fp32"
    assert script.exists(), "ds-zero's pyproject declares the ds-zero-to-fp32 console script"
    output = tmp_path / "out.pt"
    done = subprocess.run(
        [str(script), str(checkpoints[2]), str(output)], capture_output=True, timeout=300
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert "consolidating" in done.stderr.decode()  # the progress bar
    assert (
        torch.load(output, weights_only=True).keys()
        == make_model(torch.float32).state_dict().keys()
    )


def test_cli_safe_serialization(checkpoints: dict[int, Path], tmp_path: Path) -> None:
    import safetensors.torch as safetensors  # a test dependency of ds-zero

    from ds_zero._consolidate import main

    out = tmp_path / "hf"
    assert main([str(checkpoints[3]), str(out), "--safe_serialization", "-q"]) == 0
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    state = safetensors.load_file(out / "model.safetensors")
    assert "head.weight" not in state  # tied: written once
    model = make_model(torch.float32, seed=99)
    model.load_state_dict(state, strict=False)
    assert parameter_error(model, _reference()) <= 1e-5


def test_engine_layout_uses_latest_and_takes_buffers_from_the_model_states(
    checkpoints: dict[int, Path], tmp_path: Path
) -> None:
    """``save_dir/latest`` -> ``<tag>/zero`` as ds-engine writes it; buffers and frozen
    parameters, which no optimizer holds, come from ``mp_rank_00_model_states.pt``."""
    from ds_zero import consolidate

    tag = tmp_path / "global_step3"
    tag.mkdir()
    shutil.copytree(checkpoints[2], tag / "zero")
    (tmp_path / "latest").write_text("global_step3")
    module = {"tok.weight": torch.zeros(1), "running_mean": torch.arange(4, dtype=torch.float16)}
    torch.save({"module": module}, tag / "mp_rank_00_model_states.pt")
    state = consolidate(tmp_path, progress=False)
    assert torch.equal(state["running_mean"], torch.arange(4, dtype=torch.float32))
    assert state["tok.weight"].shape == (64, 32)  # the sharded value wins over the placeholder
    assert torch.equal(
        state["tok.weight"], consolidate(checkpoints[2], progress=False)["tok.weight"]
    )


def test_a_broken_checkpoint_is_not_consolidated(
    checkpoints: dict[int, Path], tmp_path: Path
) -> None:
    from ds_zero import CheckpointError, consolidate

    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints[2], path)
    (path / "zero_shards_rank00001.pt").unlink()
    with pytest.raises(CheckpointError, match=r"zero_shards_rank00001\.pt absent"):
        consolidate(path, tmp_path / "out.pt", progress=False)
    assert not (tmp_path / "out.pt").exists()
    with pytest.raises(CheckpointError, match=r"no manifest\.json"):
        consolidate(tmp_path / "nothing", progress=False)


def test_consolidation_maps_shard_files_instead_of_reading_them(
    checkpoints: dict[int, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every shard file is opened with ``mmap=True`` (only the pages of master values are
    touched; the optimizer moments stored beside them are never read)."""
    import ds_zero._manifest as manifest_module
    from ds_zero import consolidate

    calls = []
    real_load = torch.load

    def recording_load(path, *args, **kwargs):
        calls.append((Path(path).name, kwargs.get("mmap")))
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(manifest_module.torch, "load", recording_load)
    consolidate(checkpoints[2], progress=False)
    shard_loads = sorted({c for c in calls if c[0].startswith("zero_shards")})
    assert sorted(shard_loads) == [
        ("zero_shards_rank00000.pt", True),
        ("zero_shards_rank00001.pt", True),
    ]


def test_several_model_parallel_folders_are_refused_not_one_taken(tmp_path: Path) -> None:
    """An AutoTP checkpoint holds one zero_mpXX folder per tensor-parallel rank: taking the
    first for the model would return rank 0's shards as if they were the whole weights."""
    from ds_zero._consolidate import resolve_checkpoint_dir
    from ds_zero._manifest import CheckpointError
    from ds_zero._recovery_script import _zero_dirs

    for name in ("zero_mp00", "zero_mp01"):
        (tmp_path / "step1" / name).mkdir(parents=True)
        (tmp_path / "step1" / name / "manifest.json").write_text("{}")
    with pytest.raises(
        CheckpointError, match=r"zero_mp00, zero_mp01.*deepspeed\.utils\.zero_to_fp32"
    ):
        resolve_checkpoint_dir(tmp_path, tag="step1")
    assert resolve_checkpoint_dir(tmp_path / "step1" / "zero_mp01").name == "zero_mp01"
    with pytest.raises(ValueError, match="2 model-parallel ZeRO folders"):
        _zero_dirs(str(tmp_path / "step1"))
