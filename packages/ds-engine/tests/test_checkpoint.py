"""Checkpoints: DeepSpeed's layout and ``latest`` file, resume reproducing the losses of an
uninterrupted run (stages 0-2, fp32 and bf16), crash safety, weights-only loading and
client-state validation."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _engine_testing import config, loss_of, make_dataset, make_mlp

from ds_engine._checkpoint import check_client_state


def _forever(loader):
    while True:
        yield from loader


def _engine(stage: int, dtype: str, seed: int):
    import ds_engine

    cfg = config(
        train_micro_batch_size_per_gpu=2,
        gradient_accumulation_steps=2,
        gradient_clipping=1.0,
        zero_optimization={"stage": stage},
        scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 5, "warmup_min_lr": 1e-3}},
        seed=7,
        **({dtype: {"enabled": True}} if dtype != "fp32" else {}),
    )
    engine, _, loader, _ = ds_engine.initialize(
        model=make_mlp(seed, dropout=0.2), config=cfg, training_data=make_dataset(40)
    )
    return engine, _forever(loader)


def _train(engine, batches, steps: int) -> list[float]:
    losses = []
    for _ in range(steps * engine.gradient_accumulation_steps()):
        loss = loss_of(engine, next(batches))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _resume_body(rank: int, world_size: int, *, stage: int, dtype: str, path: str) -> bool:
    import torch

    total, split = 9, 4  # an epoch is 40 / (2 x 2 x world) steps: the run crosses epochs
    torch.manual_seed(100 + rank)
    engine, batches = _engine(stage, dtype, seed=0)
    uninterrupted = _train(engine, batches, total)

    torch.manual_seed(100 + rank)
    engine, batches = _engine(stage, dtype, seed=0)
    first = _train(engine, batches, split)
    engine.save_checkpoint(path, client_state={"note": "half way", "step": split})
    torch.manual_seed(12345)  # the checkpoint must restore every RNG state
    engine, _ = _engine(stage, dtype, seed=3)  # different initial weights, fresh loader
    load_path, client = engine.load_checkpoint(path)
    assert load_path == str(Path(path) / f"global_step{split}")
    assert client == {"note": "half way", "step": split}
    assert engine.global_steps == split
    rest = _train(engine, _forever(engine.training_dataloader), total - split)
    return first + rest == uninterrupted


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_resume_reproduces_the_uninterrupted_losses(stage: int, dtype: str, tmp_path: Path) -> None:
    kwargs = {"stage": stage, "dtype": dtype, "path": str(tmp_path / "ckpt")}
    assert run_on_ranks(_resume_body, 2, timeout=300, **kwargs) == [True, True]


@pytest.mark.parametrize("world_size", [1, 4])
def test_resume_on_one_and_four_ranks(world_size: int, tmp_path: Path) -> None:
    kwargs = {"stage": 2, "dtype": "fp32", "path": str(tmp_path / "ckpt")}
    assert all(run_on_ranks(_resume_body, world_size, timeout=300, **kwargs))


def _layout_body(rank: int, world_size: int, *, path: str) -> list[str]:
    engine, batches = _engine(stage=1, dtype="fp32", seed=0)
    _train(engine, batches, 2)
    engine.save_checkpoint(path)
    _train(engine, batches, 1)
    engine.save_checkpoint(path, tag="mine", save_latest=False)
    return sorted(os.listdir(path))


@pytest.mark.parametrize("world_size", [1, 2])
def test_deepspeed_layout_and_latest_file(world_size: int, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    listing = run_on_ranks(_layout_body, world_size, path=str(root), timeout=300)[0]
    # zero_to_fp32.py: the standalone recovery script beside latest, as DeepSpeed writes it
    assert listing == ["global_step2", "latest", "mine", "zero_to_fp32.py"]
    assert (root / "latest").read_text() == "global_step2"
    files = sorted(os.listdir(root / "global_step2"))
    ranks = [f"rng_state_rank{r:05d}.pt" for r in range(world_size)]
    assert files == ["ds_manifest.json", "mp_rank_00_model_states.pt", *ranks, "zero"]
    for file in (root / "global_step2").rglob("*.pt"):  # every file opens weights-only
        torch.load(file, map_location="cpu", weights_only=True)


def _module_only_body(rank: int, world_size: int, *, path: str, stage: int) -> float:
    import torch

    engine, batches = _engine(stage=stage, dtype="bf16", seed=0)
    _train(engine, batches, 3)
    engine.save_checkpoint(path)
    saved = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine, batches = _engine(stage=stage, dtype="bf16", seed=4)
    engine.load_checkpoint(path, load_module_only=True)
    assert engine.global_steps == 0  # only the weights were loaded
    for name, p in engine.module.named_parameters():
        assert torch.equal(p, saved[name])
    _train(engine, batches, 1)  # the fp32 masters were rebuilt from the loaded weights
    return max(
        (p.float() - saved[n].float()).abs().max().item()
        for n, p in engine.module.named_parameters()
    )


@pytest.mark.parametrize("stage", [0, 2])
def test_load_module_only_rebuilds_master_weights(stage: int, tmp_path: Path) -> None:
    drift = run_on_ranks(_module_only_body, 2, path=str(tmp_path / "c"), stage=stage, timeout=300)
    assert max(drift) < 0.05  # one step at lr <= 1e-2 away, not back at the other init


def _tag_body(rank: int, world_size: int, *, path: str) -> str:
    engine, _ = _engine(stage=0, dtype="fp32", seed=0)
    try:
        engine.save_checkpoint(path, tag=f"rank{rank}")
    except ValueError as exc:
        return str(exc)
    return "saved"


def test_tags_must_agree_across_ranks(tmp_path: Path) -> None:
    for message in run_on_ranks(_tag_body, 2, path=str(tmp_path / "c"), timeout=300):
        assert "differs between ranks" in message


def _client_state_body(rank: int, world_size: int, *, path: str) -> str:
    engine, _ = _engine(stage=0, dtype="fp32", seed=0)
    try:
        engine.save_checkpoint(path, client_state={"model": torch.nn.Linear(2, 2)})
    except TypeError as exc:
        return str(exc)
    return "saved"


def test_client_state_with_objects_is_refused_at_save(tmp_path: Path) -> None:
    message = run_on_ranks(_client_state_body, 1, path=str(tmp_path / "c"))[0]
    assert "client_state['model']" in message and "Linear" in message
    assert not (tmp_path / "c").exists() or "latest" not in os.listdir(tmp_path / "c")


def test_client_state_accepts_tensors_and_plain_values() -> None:
    check_client_state({"a": [1, 2.0, "x", None, (True, b"b")], "t": torch.ones(2), 3: {}})
    with pytest.raises(TypeError, match=r"client_state\['f'\]\[0\]"):
        check_client_state({"f": [lambda: 0]})


_CRASHING_SAVE = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {tests!r})
    import torch
    import ds_engine
    import ds_engine._checkpoint as ckpt
    from _engine_testing import config, loss_of, make_dataset, make_mlp

    engine, *_ = ds_engine.initialize(model=make_mlp(), config=config())
    data = make_dataset(16)
    def train(step):
        engine.backward(loss_of(engine, [t[4 * step : 4 * step + 4] for t in data.tensors]))
        engine.step()
    train(0)
    engine.save_checkpoint({root!r}, tag="good")
    torch.save(dict(engine.module.state_dict()), {expected!r})
    train(1)
    real_write = ckpt._write
    def dying_write(obj, path):
        real_write(obj, path)
        os._exit(9)  # the process is killed after its first file of the new checkpoint
    ckpt._write = dying_write
    engine.save_checkpoint({root!r}, tag="bad")
    """
)


def _load_good_body(rank: int, world_size: int, *, root: str, expected: str) -> str:
    import ds_engine

    engine, *_ = ds_engine.initialize(model=make_mlp(seed=9), config=config())
    load_path, _ = engine.load_checkpoint(root)
    want = torch.load(expected, weights_only=True)
    for name, value in engine.module.state_dict().items():
        assert torch.equal(value, want[name])
    return Path(load_path).name


@pytest.mark.slow  # test_checkpoint_crash.py enumerates every kill point of a save in the default run
def test_a_crash_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    root, expected = tmp_path / "ckpt", tmp_path / "expected.pt"
    script = _CRASHING_SAVE.format(
        tests=str(Path(__file__).parent), root=str(root), expected=str(expected)
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    with socket.socket() as s:  # not the default 29500: another job on the machine may hold it
        s.bind(("127.0.0.1", 0))
        env["MASTER_PORT"] = str(s.getsockname()[1])
    done = subprocess.run([sys.executable, "-c", script], env=env, timeout=300, capture_output=True)
    assert done.returncode == 9, done.stderr.decode()[-2000:]
    assert (root / "latest").read_text() == "good"
    assert not (root / "bad").exists()
    loaded = run_on_ranks(_load_good_body, 1, root=str(root), expected=str(expected))
    assert loaded == ["good"]
