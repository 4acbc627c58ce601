"""``export_safetensors``: Hugging Face style safetensors files (one, or sharded with an index)
from a sharded checkpoint or a live stage 3 model, written without the ``safetensors`` package
and read back with it."""

from __future__ import annotations

import itertools
import json
import struct
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

STEPS, ROWS = 2, 8


def _stage3(rank: int, world_size: int):
    from ds_zero import Stage3Optimizer, ZeroConfig

    model = make_model(torch.float32)
    section = {"stage": 3, "stage3_param_persistence_threshold": 64}
    zero = Stage3Optimizer(model, adam(list(model.parameters())), ZeroConfig.from_dict(section))
    for batch in global_batches(STEPS, ROWS):
        (micro,) = micro_batches(batch, rank, world_size, 1)
        zero.backward(model(micro))
        zero.step()
    return model, zero


def _save_body(rank: int, world_size: int, *, path: str) -> None:
    from ds_zero import save_sharded_checkpoint

    _, zero = _stage3(rank, world_size)
    save_sharded_checkpoint(path, zero)


def _reference() -> dict[str, torch.Tensor]:
    return reference_train(make_model(torch.float32), global_batches(STEPS, ROWS), Recipe(adam))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("export") / "ckpt"
    run_on_ranks(_save_body, 2, path=str(path), timeout=300)
    return path


def _read_header(path: Path) -> dict:
    """The header, parsed by hand (the format, independent of the safetensors package)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    assert length % 8 == 0
    header = json.loads(data[8 : 8 + length])
    ends = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(ends))
    assert 8 + length + ends[-1][1] == len(data)  # no gap, nothing after the last tensor
    return header


def test_sharded_export_has_an_index_and_equals_training(checkpoint: Path, tmp_path: Path) -> None:
    import safetensors.torch as safetensors  # a test dependency of ds-zero

    from ds_zero import consolidate, export_safetensors

    files = export_safetensors(checkpoint, tmp_path, max_shard_size="40KB", progress=False)
    assert len(files) > 2
    assert [f.name for f in files] == [
        f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)
    ]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    state: dict[str, torch.Tensor] = {}
    for file in files:
        header = _read_header(file)
        loaded = safetensors.load_file(file)
        assert set(loaded) == set(header) - {"__metadata__"}
        assert all(index["weight_map"][name] == file.name for name in loaded)
        assert file.stat().st_size <= 40_000 or len(loaded) == 1
        state.update(loaded)
    assert set(state) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in state.values())
    assert "head.weight" not in state  # tied to tok.weight: written once
    consolidated = consolidate(checkpoint, progress=False)
    assert all(torch.equal(state[k], consolidated[k]) for k in state)
    model = make_model(torch.float32, seed=99)
    model.load_state_dict(state, strict=False)
    assert parameter_error(model, _reference()) <= 1e-5


def test_single_file_in_bf16(checkpoint: Path, tmp_path: Path) -> None:
    import safetensors.torch as safetensors  # a test dependency of ds-zero

    from ds_zero import consolidate, export_safetensors

    files = export_safetensors(checkpoint, tmp_path, dtype=torch.bfloat16, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"] == [f.name for f in files]
    header = _read_header(files[0])
    assert header["__metadata__"] == {"format": "pt"}
    assert header["tok.weight"]["dtype"] == "BF16" and header["tok.weight"]["shape"] == [64, 32]
    loaded = safetensors.load_file(files[0])
    consolidated = consolidate(checkpoint, progress=False)
    for name, value in loaded.items():
        assert torch.equal(value, consolidated[name].to(torch.bfloat16)), name


def _live_export_body(rank: int, world_size: int, *, out: str) -> list[int]:
    from ds_zero import export_safetensors

    model, zero = _stage3(rank, world_size)
    export_safetensors(zero, out, max_shard_size="30KB", progress=False)
    return [p.data.numel() for p in model.parameters()]  # still partitioned afterwards


def test_live_stage3_model_exports_one_gathered_parameter_at_a_time(tmp_path: Path) -> None:
    import safetensors.torch as safetensors  # a test dependency of ds-zero

    sizes = run_on_ranks(_live_export_body, 2, out=str(tmp_path), timeout=300)
    assert all(0 in s for s in sizes)  # partitioned parameters were released again
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    state: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        state.update(safetensors.load_file(tmp_path / file))
    model = make_model(torch.float32, seed=99)
    model.load_state_dict(state, strict=False)
    assert set(state) == {n for n, _ in model.named_parameters()}
    assert parameter_error(model, _reference()) <= 1e-5


def test_plain_module_export_matches_its_state_dict(tmp_path: Path) -> None:
    from ds_zero import export_safetensors

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    (file,) = export_safetensors(model, tmp_path, progress=False)
    header = _read_header(file)
    data = file.read_bytes()
    base = 8 + struct.unpack("<Q", data[:8])[0]
    expected = {n: t for n, t in model.state_dict().items() if n != "1.num_batches_tracked"}
    assert header["1.num_batches_tracked"]["dtype"] == "I64"
    for name, value in expected.items():
        begin, end = header[name]["data_offsets"]
        raw = torch.frombuffer(bytearray(data[base + begin : base + end]), dtype=value.dtype)
        assert torch.equal(raw.view(value.shape), value), name


@pytest.mark.parametrize(
    ("size", "expected"),
    [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 * 2**30), (1234, 1234), ("1.5KB", 1500)],
)
def test_parse_size(size: int | str, expected: int) -> None:
    from ds_zero._safetensors import parse_size

    assert parse_size(size) == expected


def test_parse_size_rejects_nonsense() -> None:
    from ds_zero._safetensors import parse_size

    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size("5 parsecs")


def test_a_live_model_with_experts_split_over_ranks_is_refused(tmp_path: Path) -> None:
    """DeepSpeed's MoE marks expert parameters with ``group_name = "ep_size_<n>"``: with n > 1
    this rank holds only its own experts, so writing the module would leave the rest out."""
    from ds_zero import export_safetensors

    model = torch.nn.Linear(2, 2)
    for p in model.parameters():
        p.group_name = "ep_size_2"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"ep_size_2.*_zero3_consolidated_16bit_state_dict"):
        export_safetensors(model, tmp_path / "split", progress=False)
    for p in model.parameters():
        p.group_name = "ep_size_1"  # type: ignore[attr-defined]
    assert export_safetensors(model, tmp_path / "whole", progress=False)  # every expert here
