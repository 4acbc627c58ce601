"""``save_16bit_model`` (and accelerate's ``_zero3_consolidated_16bit_state_dict``) with MoE
expert parallelism: the file holds the whole model, every expert under its global id gathered
from the rank that holds it (at ZeRO-3 from its partitions), and loads strictly into the
``ep_size=1`` model (see [Note: consolidated weights with expert parallelism])."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
import test_moe as tm

PROBE = 99  # the batch step whose loss the saved model must reproduce


def _save_body(rank: int, world_size: int, *, root: str, stage: int, ep_size: int) -> dict:
    """Train 3 steps at ``ep_size``, save the 16-bit model; this rank's gathered weights (global
    names), its loss on the probe batch and (stage 3) the consolidated state dict."""
    import ds_engine

    config = tm._config3(stage)
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    engine, *_ = ds_engine.initialize(model=tm._full_model(ep_size, seed=0), config=config)
    tm._train_steps(engine, rank, range(3))
    assert engine.save_16bit_model(root, "model.bin")
    consolidated = engine._zero3_consolidated_16bit_state_dict() if stage == 3 else None
    if consolidated is not None:  # docs/moe.md's safetensors recipe: the dict, on rank 0
        import ds_zero

        ds_zero.export_safetensors(consolidated, Path(root) / "hf", progress=False)
    with torch.no_grad():
        probe = engine(tm._tokens(PROBE, rank)).item()
    return {"state": tm._global_state(engine), "probe": probe, "consolidated": consolidated}


@pytest.mark.parametrize(
    ("world_size", "stage", "ep_size"),
    [
        (2, 3, 2),
        pytest.param(2, 2, 2, marks=pytest.mark.slow),
        pytest.param(4, 2, 2, marks=pytest.mark.slow),
        pytest.param(4, 3, 2, marks=pytest.mark.slow),
        pytest.param(4, 3, 4, marks=pytest.mark.slow),  # one replica per expert
    ],
)
def test_save_16bit_model_holds_every_expert_by_global_id(
    tmp_path: Path, world_size: int, stage: int, ep_size: int
) -> None:
    """The file loads with strict=True into a fresh ep_size=1 model, equals the trained
    engine's gathered weights exactly (keys in the ep_size=1 model's order) and reproduces
    every rank's loss on a new batch."""
    results = run_on_ranks(
        _save_body, world_size, root=str(tmp_path), stage=stage, ep_size=ep_size, timeout=300
    )
    trained = tm._merged([r["state"] for r in results])
    saved = torch.load(tmp_path / "model.bin", weights_only=True)
    model = tm._model(1, seed=7)
    assert list(saved) == list(model.state_dict())  # every expert, the ep_size=1 order
    model.load_state_dict(saved, strict=True)
    assert all(torch.equal(saved[k], v) for k, v in trained.items())
    with torch.no_grad():
        for rank, result in enumerate(results):
            expected = model(tm._tokens(PROBE, rank)).item()
            assert abs(result["probe"] - expected) <= 1e-5 * abs(expected), (rank, result)
    if stage == 3:  # accelerate's get_state_dict path: the same whole model, on rank 0 only
        consolidated = results[0]["consolidated"]
        assert list(consolidated) == list(saved)
        assert all(torch.equal(consolidated[k], v) for k, v in saved.items())
        assert all(r["consolidated"] is None for r in results[1:])
        from safetensors.torch import load_file

        exported = load_file(tmp_path / "hf" / "model.safetensors")
        assert exported.keys() == saved.keys()
        assert all(torch.equal(exported[k], v) for k, v in saved.items())
