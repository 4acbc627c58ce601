"""Universal checkpoints: saved on N ranks under one ZeRO stage, loaded on M ranks under another
(stages 0-3), training continues with the losses of an uninterrupted single-process run; a
corrupted byte, a truncated or missing file, a gap and duplicated coverage are each refused
with a message naming the tensor and the file."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _ds_zero_testing import adam, cpu_adam, global_batches, make_model, micro_batches

STEPS, SAVE_AT, ROWS = 6, 3, 8
PERSIST = 64  # stage 3: LayerNorm weights stay whole, the rest is partitioned


def _optimizer(stage: int, *, seed: int, freeze: bool = False, nvme: str | None = None):
    """A model and its ZeRO wrapper (stages 0-2: ZeroOptimizer, 3: Stage3Optimizer);
    ``freeze``: the position embedding is frozen (held by no optimizer, still checkpointed);
    ``nvme``: optimizer state swapped to files under that folder between steps."""
    import torch

    from ds_zero import Stage3Optimizer, ZeroConfig, ZeroOptimizer

    model = make_model(torch.float32, seed=seed)
    model.pos.weight.requires_grad_(not freeze)
    section = {"stage": stage, "reduce_bucket_size": 2000}
    if stage == 3:
        section["stage3_param_persistence_threshold"] = PERSIST
        wrapper = Stage3Optimizer
    else:
        wrapper = ZeroOptimizer
    make_optimizer = adam
    if nvme is not None:
        section["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme}
        make_optimizer = cpu_adam
    config = ZeroConfig.from_dict(section)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return model, wrapper(model, make_optimizer(trainable), config)


def _train(model, zero, rank: int, world_size: int, steps: range) -> list[float]:
    """Train ``steps`` of the global batches; this rank's micro-batch loss of each step."""
    batches = global_batches(STEPS, ROWS)
    losses = []
    for step in steps:
        (micro,) = micro_batches(batches[step], rank, world_size, 1)
        loss = model(micro)
        losses.append(loss.item())
        zero.backward(loss)
        zero.step()
    return losses


def _reference_losses(rank: int, world_size: int, freeze: bool) -> list[float]:
    """Single process, full batches: the loss this rank's micro-batch has before each step."""
    import torch

    model = make_model(torch.float32)
    model.pos.weight.requires_grad_(not freeze)
    optimizer = adam([p for p in model.parameters() if p.requires_grad])
    losses = []
    for batch in global_batches(STEPS, ROWS):
        (micro,) = micro_batches(batch, rank, world_size, 1)
        with torch.no_grad():
            losses.append(float(model(micro)))
        model(batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _save_body(
    rank: int, world_size: int, *, path: str, stage: int, freeze: bool = False, nvme=None
) -> None:
    from ds_zero import save_sharded_checkpoint

    model, zero = _optimizer(stage, seed=0, freeze=freeze, nvme=nvme)
    _train(model, zero, rank, world_size, range(SAVE_AT))
    save_sharded_checkpoint(path, zero, client_state={"step": SAVE_AT})


def _resume_body(
    rank: int, world_size: int, *, path: str, stage: int, freeze: bool, nvme=None
) -> tuple[float, float]:
    from ds_zero import load_sharded_checkpoint

    # Another seed: everything, frozen parameters included, comes from the checkpoint.
    model, zero = _optimizer(stage, seed=123, freeze=freeze, nvme=nvme)
    assert load_sharded_checkpoint(path, zero) == {"step": SAVE_AT}
    assert zero.global_steps == SAVE_AT
    losses = _train(model, zero, rank, world_size, range(SAVE_AT, STEPS))
    expected = _reference_losses(rank, world_size, freeze)[SAVE_AT:]
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
    return worst, losses[-1]


CASES = [
    pytest.param(4, 2, 2, 2, False, id="4to2-stage2"),
    pytest.param(2, 4, 1, 2, False, id="2to4-stage1to2"),
    pytest.param(2, 1, 2, 0, False, id="2to1-stage2to0"),
    pytest.param(2, 2, 3, 2, False, id="2to2-stage3to2"),
    pytest.param(2, 2, 2, 3, False, id="2to2-stage2to3"),
    pytest.param(2, 4, 2, 3, True, id="2to4-stage2to3-frozen"),
    pytest.param(4, 2, 3, 3, False, id="4to2-stage3", marks=pytest.mark.slow),
    pytest.param(2, 4, 0, 1, False, id="2to4-stage0to1", marks=pytest.mark.slow),
    pytest.param(2, 1, 3, 1, True, id="2to1-stage3to1-frozen", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("saved_on", "loaded_on", "saved_stage", "loaded_stage", "freeze"), CASES)
def test_resume_on_another_world_size_and_stage_continues_exactly(
    tmp_path: Path, saved_on: int, loaded_on: int, saved_stage: int, loaded_stage: int, freeze: bool
) -> None:
    path = str(tmp_path / "ckpt")
    run_on_ranks(_save_body, saved_on, path=path, stage=saved_stage, freeze=freeze, timeout=300)
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    assert manifest["world_size"] == saved_on and manifest["stage"] == saved_stage
    assert manifest["aliases"] == {"head.weight": "tok.weight"}
    shard_files = sorted(p.name for p in Path(path).glob("zero_shards_rank*.pt"))
    assert shard_files == [f"zero_shards_rank{r:05d}.pt" for r in range(saved_on)]
    results = run_on_ranks(
        _resume_body, loaded_on, path=path, stage=loaded_stage, freeze=freeze, timeout=300
    )
    assert max(err for err, _ in results) <= 1e-5, results


def test_nvme_swapped_optimizer_state_is_saved_and_loaded(tmp_path: Path) -> None:
    """The moments live in swap files between steps: saving swaps them in to read them, loading
    writes the new ones out (2 ranks, stage 2 -> 1 rank, stage 1)."""
    path = str(tmp_path / "ckpt")
    run_on_ranks(_save_body, 2, path=path, stage=2, nvme=str(tmp_path / "swap0"), timeout=300)
    entry = json.loads((Path(path) / "manifest.json").read_text())["tensors"]["tok.weight"]
    assert entry["values"] == ["exp_avg", "exp_avg_sq", "param"]
    results = run_on_ranks(
        _resume_body, 1, path=path, stage=1, freeze=False, nvme=str(tmp_path / "swap1"), timeout=300
    )
    assert max(err for err, _ in results) <= 1e-5, results


# --- refusing broken checkpoints -------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A stage 2 checkpoint saved on 2 ranks after a few steps (copy it before breaking it)."""
    path = tmp_path_factory.mktemp("saved") / "ckpt"
    run_on_ranks(_save_body, 2, path=str(path), stage=2, timeout=300)
    return path


def _copy(saved: Path, tmp_path: Path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(saved, target)
    return target


def _error(path: Path) -> str:
    from ds_zero import CheckpointError, verify_checkpoint

    with pytest.raises(CheckpointError) as info:
        verify_checkpoint(path)
    return str(info.value)


def _first_piece(path: Path, file: str) -> tuple[str, int, int]:
    manifest = json.loads((path / "manifest.json").read_text())
    for name, entry in manifest["tensors"].items():
        for f, _, start, stop in entry["pieces"]:
            if f == file:
                return name, start, stop
    raise AssertionError(f"{file} holds nothing")


def test_an_intact_checkpoint_verifies(saved: Path) -> None:
    from ds_zero import verify_checkpoint

    manifest = verify_checkpoint(saved)
    assert set(manifest["files"]) == {
        "zero_shards_rank00000.pt",
        "zero_shards_rank00001.pt",
        "scalars.pt",
        "client_state.pt",
    }
    entry = manifest["tensors"]["tok.weight"]
    assert entry["shape"] == [64, 32] and entry["dtype"] == "torch.float32"
    assert entry["values"] == ["exp_avg", "exp_avg_sq", "param"]


def test_a_corrupted_byte_is_refused(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    file = path / "zero_shards_rank00001.pt"
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x40
    file.write_bytes(bytes(data))
    name, start, stop = _first_piece(path, file.name)
    message = _error(path)
    assert f"tensor {name!r} elements [{start}, {stop}) are missing" in message
    assert "zero_shards_rank00001.pt corrupted" in message


def test_a_truncated_file_is_refused(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    file = path / "zero_shards_rank00000.pt"
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.truncate(size - 100)
    name, start, stop = _first_piece(path, file.name)
    message = _error(path)
    assert f"tensor {name!r} elements [{start}, {stop}) are missing" in message
    assert f"zero_shards_rank00000.pt truncated ({size - 100} of {size} bytes)" in message


def test_a_missing_file_is_refused(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    (path / "zero_shards_rank00001.pt").unlink()
    name, start, stop = _first_piece(path, "zero_shards_rank00001.pt")
    message = _error(path)
    assert (
        f"tensor {name!r} elements [{start}, {stop}) are missing" in message
        and "zero_shards_rank00001.pt absent" in message
    )


def _edit_manifest(path: Path, edit) -> None:
    """A manifest as a faulty writer would make it: edited, then sealed again."""
    from ds_zero._integrity import seal

    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(seal(manifest)))


def test_duplicated_coverage_is_refused(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)

    def duplicate(manifest) -> None:  # rank 1's piece of up.weight claimed by rank 0 as well
        pieces = manifest["tensors"]["blocks.0.up.weight"]["pieces"]
        theirs = next(p for p in pieces if p[0] == "zero_shards_rank00001.pt")
        pieces.append(["zero_shards_rank00000.pt", theirs[1], theirs[2], theirs[3]])

    _edit_manifest(path, duplicate)
    message = _error(path)
    assert "tensor 'blocks.0.up.weight' elements [" in message
    assert "are covered twice: by zero_shards_rank0000" in message


def test_a_gap_is_refused(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    removed = {}

    def drop(manifest) -> None:
        pieces = manifest["tensors"]["blocks.1.down.weight"]["pieces"]
        removed["piece"] = pieces.pop()

    _edit_manifest(path, drop)
    _, _, start, stop = removed["piece"]
    message = _error(path)
    assert f"tensor 'blocks.1.down.weight' elements [{start}, {stop}) are missing" in message


def _load_broken_body(rank: int, world_size: int, *, path: str) -> str:
    from ds_zero import CheckpointError, load_sharded_checkpoint

    _, zero = _optimizer(1, seed=5)
    try:
        load_sharded_checkpoint(path, zero)
    except CheckpointError as exc:
        return str(exc)
    return "loaded"


def test_every_rank_refuses_a_broken_checkpoint(saved: Path, tmp_path: Path) -> None:
    path = _copy(saved, tmp_path)
    with open(path / "zero_shards_rank00000.pt", "r+b") as f:
        f.truncate(1000)
    messages = run_on_ranks(_load_broken_body, 2, path=str(path), timeout=300)
    assert all("zero_shards_rank00000.pt truncated (1000 of" in m for m in messages), messages


class _BrokenShards:
    """A broken ``checkpoint_shards``: two pieces of one tensor that overlap (``overlap``) or
    disagree about its shape."""

    param_groups: list = []

    def __init__(self, overlap: bool) -> None:
        self.overlap = overlap

    def checkpoint_shards(self):
        import torch

        from ds_zero import TensorShard

        values = {"param": torch.zeros(6)}
        other_shape = (10,) if self.overlap else (2, 5)
        return [
            TensorShard("w", (10,), torch.float32, 0, 6, values),
            TensorShard("w", other_shape, torch.float32, 4, 10, values),
        ]

    def load_checkpoint_shards(self, lookup) -> None:
        raise AssertionError("not loaded")


@pytest.mark.parametrize(
    ("overlap", "message"),
    [
        (True, r"tensor 'w' elements \[4, 6\) are covered twice"),
        (False, r"tensor 'w' is torch.float32 \[2, 5\] in zero_shards_rank00000.pt but"),
    ],
)
def test_saving_broken_shards_publishes_nothing(
    tmp_path: Path, overlap: bool, message: str
) -> None:
    from ds_zero import CheckpointError, save_sharded_checkpoint

    with pytest.raises(CheckpointError, match=message):
        save_sharded_checkpoint(tmp_path / "ckpt", _BrokenShards(overlap))
    assert list(tmp_path.iterdir()) == []
