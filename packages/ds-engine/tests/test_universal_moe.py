"""MoE universal checkpoints: ``ds-to-universal`` names every expert by its global id and ds's
universal load finds a rank's experts by theirs, at any ``ep_size``, world size and ZeRO stage
(see ``_universal_load``'s [Note: MoE universal]).

Each loss is the mean over the global batch; the routing (top-1, capacity 4 tokens per expert
on 4 tokens per rank) drops no token at 2 ranks whatever the ``ep_size``, so a run reloaded at
another ``ep_size`` continues the same trajectory: within a relative 1e-5 (the universal
tests' tolerance). DeepSpeed's own ``ds_to_universal`` fails on a native MoE checkpoint of
``ep_size`` 2 (it merges the ranks' experts that share a local name), so there is no DeepSpeed
leg for ``ep_size`` above 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
import _deepspeed_fixtures as fx
import test_deepspeed_write as tw

RTOL = 1e-5
EXPERT = "moe.deepspeed_moe.experts.deepspeed_experts"


def _universal(source: Path, out: Path) -> Path:
    from ds_engine.checkpoint.ds_to_universal import main

    assert (
        main(["--input_folder", str(source), "--output_folder", str(out), "--inject_missing_state"])
        == 0
    )
    return out


def _resume_body(rank: int, world: int, model: str, stage: int, load: str) -> list[float]:
    """ds loads the universal folder under ``load`` (``model`` as in test_deepspeed_write) at
    ``stage`` and trains the next 3 steps."""
    cfg = tw._config(stage, "fp32", world)
    cfg["checkpoint"] = {"load_universal": True}
    ep_size = 1 if model == "moe-ep1" else world
    engine = fx.build_moe_engine(cfg, world, ep_size=ep_size, multi=model == "moe-multi")
    path, _ = engine.load_checkpoint(load)
    assert path is not None and engine.global_steps == 3
    return fx.train(engine, 3, 3, rank, world, "fp32")


def test_moe_universal_names_experts_globally(tmp_path: Path) -> None:
    """``ds-to-universal`` on DeepSpeed's MoE checkpoint (ep_size 2, ZeRO-2, 2 ranks): each
    expert whole under its global id, its state equal to the expert's slice of the rank file
    that held it, the expert files copied, both groups' hyper-parameters kept."""
    from ds_engine._deepspeed_ckpt import load_file

    source = fx.FIXTURES / "moe_zero2_w2" / "step3"
    out = _universal(source, tmp_path / "step3_universal")
    for rank in (0, 1):  # rank r holds global expert r as its local expert 0 (ep_size 2)
        optim = load_file(source / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
        flat = optim["optimizer_state_dict"]["single_partition_of_fp32_groups"][1]
        moment = optim["optimizer_state_dict"]["base_optimizer_state"]["state"][1]["exp_avg"]
        saved = torch.load(out / "zero" / f"{EXPERT}.{rank}.weight" / "fp32.pt")["param"]
        assert saved.shape == (16, 16)
        assert torch.equal(saved.flatten(), flat[:256])
        exp_avg = torch.load(out / "zero" / f"{EXPERT}.{rank}.weight" / "exp_avg.pt")["param"]
        assert torch.equal(exp_avg.flatten(), moment[:256])
        copied = out / f"layer_0_expert_{rank}_mp_rank_00_model_states.pt"
        assert copied.read_bytes() == (source / copied.name).read_bytes()
    assert not (out / "zero" / f"{EXPERT}.2.weight").exists()
    groups = load_file(out / "zero" / "optimizer_state.pt")["param_groups"]
    assert len(groups) == 2 and all(g["weight_decay"] == 0.01 for g in groups)  # dense, experts


@pytest.mark.slow
@pytest.mark.parametrize("model", ["moe", "moe-ep1"])
def test_deepspeed_moe_checkpoint_through_universal(model: str, tmp_path: Path) -> None:
    """DeepSpeed 0.19.8's MoE checkpoint (ep_size 2, ZeRO-2, 2 ranks), converted by
    ``ds-to-universal``, resumes in ds at ZeRO-1 with ep_size 2 and with ep_size 1 on
    DeepSpeed's own next losses."""
    case = fx.expected()["cases"]["moe_zero2_w2"]
    _universal(fx.FIXTURES / "moe_zero2_w2" / "step3", tmp_path / "step3_universal")
    got = run_on_ranks(_resume_body, 2, model, 1, str(tmp_path), timeout=240)[0]
    torch.testing.assert_close(got, case["resumed_losses"], rtol=RTOL, atol=0)


def _native3_body(rank: int, world: int, model: str, stage: int, out: str) -> list[float]:
    engine = tw._engine(model, stage, "fp32", world)
    tw._train(engine, model, 0, 3, rank, world, "fp32")
    engine.save_checkpoint(out)
    return tw._train(engine, model, 3, 3, rank, world, "fp32")


_DS_CASES = [
    ("moe", 2, "moe-ep1", 1),
    ("moe-multi", 2, "moe-multi", 1),
    ("moe", 0, "moe", 2),
    ("moe-multi", 3, "moe-multi", 1),  # ds's ZeRO-3 MoE (its manifest names experts globally)
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("saved", "stage", "loaded", "load_stage"),
    _DS_CASES,
    ids=[f"{a}-z{b}-to-{c}-z{d}" for a, b, c, d in _DS_CASES],
)
def test_ds_moe_checkpoint_through_universal(
    saved: str, stage: int, loaded: str, load_stage: int, tmp_path: Path
) -> None:
    """A ds MoE checkpoint (2 ranks: ep_size 2; or ep_size 1 and 2 layers) through
    ``ds-to-universal`` resumes in ds at another ZeRO stage and ``ep_size`` on the
    uninterrupted run's losses."""
    save_dir = tmp_path / "ds"
    continued = run_on_ranks(_native3_body, 2, saved, stage, str(save_dir), timeout=240)[0]
    tag = (save_dir / "latest").read_text().strip()
    _universal(save_dir / tag, save_dir / f"{tag}_universal")
    got = run_on_ranks(_resume_body, 2, loaded, load_stage, str(save_dir), timeout=240)[0]
    torch.testing.assert_close(got, continued, rtol=RTOL, atol=0)


@pytest.mark.slow
@pytest.mark.skipif(not fx.DSREF_PYTHON.exists(), reason=f"no DeepSpeed at {fx.DSREF_PYTHON}")
def test_deepspeed_loads_ds_moe_universal_at_ep_size_1(tmp_path: Path) -> None:
    """Real DeepSpeed loads ds's MoE universal folder where its loader can: ``ep_size`` 1
    (global and local expert names agree). ds (2 ranks, ZeRO-2) -> ``ds-to-universal`` ->
    DeepSpeed (2 ranks, ZeRO-1, ``checkpoint.load_universal``) continues ds's 3 losses."""
    import json
    import os
    import subprocess

    save_dir = tmp_path / "ds"
    continued = run_on_ranks(_native3_body, 2, "moe-ep1", 2, str(save_dir), timeout=240)[0]
    tag = (save_dir / "latest").read_text().strip()
    _universal(save_dir / tag, save_dir / f"{tag}_universal")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "DS_BUILD_OPS": "0"}
    command = [str(fx.DSREF_PYTHON), str(tw.RESUMER), str(save_dir), "--model", "moe-ep1"]
    command += ["--world", "2", "--stage", "1", "--steps", "3", "--universal"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    assert "error" not in result and result["first_step"] == 3, result
    torch.testing.assert_close(result["losses"], continued, rtol=RTOL, atol=0)
