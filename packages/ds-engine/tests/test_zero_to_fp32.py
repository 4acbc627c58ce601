"""``deepspeed.utils.zero_to_fp32`` parity over an engine checkpoint with a frozen parameter and a
buffer, saved on 2 gloo ranks: ``exclude_frozen_parameters``, ``lazy_mode`` and
``to_torch_tensor``, sharded ``.bin``/safetensors output with transformers' index files, the
DeepSpeed file helpers Lightning imports, and the standalone ``zero_to_fp32.py`` written into
the checkpoint folder, run where no ds package can be imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _engine_testing import config, loss_of, make_mlp

FROZEN = "0.bias"


def _model() -> torch.nn.Module:
    model = make_mlp()
    model.register_buffer("scale", torch.tensor([2.0, 3.0]))
    model.get_parameter(FROZEN).requires_grad_(False)
    return model


def _train_and_save(rank: int, world_size: int, stage: int, folder: str) -> dict:
    import ds_engine as deepspeed
    from ds_engine.utils import safe_get_full_fp32_param

    model = _model()
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=config(train_micro_batch_size_per_gpu=2, zero_optimization={"stage": stage}),
    )
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        batch = [torch.randn(4, 8, generator=gen), torch.randn(4, 4, generator=gen)]
        batch = [t.to(engine.device) for t in batch]
        engine.backward(loss_of(engine, [t.chunk(world_size)[rank] for t in batch]))
        engine.step()
    engine.save_checkpoint(folder, tag="step2")
    want = {}
    for name, p in model.named_parameters():
        full = safe_get_full_fp32_param(p) if p.requires_grad else None
        if full is None:  # frozen: no optimizer master
            from ds_zero import GatheredParameters

            with GatheredParameters([p]):
                full = p.detach().float().clone()
        want[name] = full.cpu()
    want["scale"] = model.scale.cpu()
    return want


@pytest.fixture(
    scope="module",
    params=[pytest.param(2, marks=pytest.mark.slow), 3],
    ids=["stage2", "stage3"],
)
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp(f"z2fp32_stage{request.param}") / "ckpt"
    want = run_on_ranks(_train_and_save, 2, request.param, str(folder), timeout=300)[0]
    return folder, want


def _equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_state_dict_frozen_and_lazy(saved) -> None:
    from ds_engine.utils.zero_to_fp32 import (
        get_fp32_state_dict_from_zero_checkpoint,
        to_torch_tensor,
    )

    folder, want = saved
    _equal(get_fp32_state_dict_from_zero_checkpoint(folder), want)
    without = get_fp32_state_dict_from_zero_checkpoint(folder, exclude_frozen_parameters=True)
    _equal(without, {k: v for k, v in want.items() if k != FROZEN})  # the buffer stays
    lazy = get_fp32_state_dict_from_zero_checkpoint(folder, tag="step2", lazy_mode=True)
    assert not any(torch.is_tensor(v) for v in lazy.values())
    assert {k: tuple(v.shape) for k, v in lazy.items()} == {
        k: tuple(v.shape) for k, v in want.items()
    }
    assert torch.equal(lazy["3.weight"].contiguous(), want["3.weight"])
    _equal(to_torch_tensor(lazy), want)
    empty = to_torch_tensor(lazy, return_empty_tensor=True, dtype="bf16")
    assert empty["3.weight"].dtype == torch.bfloat16 and empty["3.weight"].shape == (4, 16)


def test_sharded_outputs_and_index(saved, tmp_path: Path) -> None:
    import safetensors.torch

    from ds_engine.utils.zero_to_fp32 import main

    folder, want = saved
    for safe, stem, ext in ((False, "pytorch_model", "bin"), (True, "model", "safetensors")):
        out = tmp_path / stem
        flags = ["--max_shard_size", "300B", "--exclude_frozen_parameters"]
        assert (
            main([str(folder), str(out), "-t", "step2", *flags] + ["--safe_serialization"] * safe)
            == 0
        )
        index = json.loads((out / f"{stem}.{ext}.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert len(files) > 1 and files[0] == f"{stem}-00001-of-{len(files):05d}.{ext}"
        assert sorted(p.name for p in out.glob(f"{stem}-*")) == files
        got = {}
        for file in files:
            load = safetensors.torch.load_file if safe else torch.load
            got.update(load(out / file))
        expected = {k: v for k, v in want.items() if k != FROZEN}
        _equal(got, expected)
        assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in expected.values())
        assert set(index["weight_map"]) == set(expected)


def test_file_helpers(saved) -> None:
    from ds_engine.utils.zero_to_fp32 import (
        get_model_state_file,
        get_model_state_files,
        get_optim_files,
    )

    folder, _ = saved
    tag = folder / "step2"
    assert get_model_state_file(tag, 2) == str(tag / "mp_rank_00_model_states.pt")
    assert get_model_state_files(tag) == [str(tag / "mp_rank_00_model_states.pt")]
    with pytest.raises(FileNotFoundError, match=r"_optim_states\.pt"):
        get_optim_files(tag)  # ds keeps the optimizer in zero/
    with pytest.raises(FileNotFoundError, match="doesn't exist"):
        get_model_state_file(folder / "nope", 3)


_NO_DS = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"deepspeed"} or name.startswith("ds_"):
            raise ImportError(f"{name} must not be imported")
sys.path = [p for p in sys.path if "/packages/" not in p and "/kernels/" not in p]
sys.meta_path.insert(0, Block())
import runpy
script = runpy.run_path(sys.argv[1], run_name="zero_to_fp32")
for args in sys.argv[2:]:
    assert script["main"](args.split("|")) == 0
assert not [m for m in sys.modules if m.startswith("ds_") or m == "deepspeed"]
"""


def test_recovery_script_runs_without_ds(saved, tmp_path: Path) -> None:
    import safetensors.torch

    folder, want = saved
    script = folder / "zero_to_fp32.py"
    assert script.is_file()  # written by save_checkpoint, as DeepSpeed copies its script
    runs = [
        f"{folder}|{tmp_path / 'bin'}",
        f"{folder}|{tmp_path / 'safe'}|--safe_serialization|-t|step2",
        f"{folder}|{tmp_path / 'x'}|--exclude_frozen_parameters|--max_shard_size|300B",
    ]
    command = [sys.executable, "-c", _NO_DS, str(script), *runs]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    _equal(torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True), want)
    _equal(safetensors.torch.load_file(tmp_path / "safe" / "model.safetensors"), want)
    index = json.loads((tmp_path / "x" / "pytorch_model.bin.index.json").read_text())
    assert set(index["weight_map"]) == set(want) - {FROZEN}
    got = {}
    for file in set(index["weight_map"].values()):
        got.update(torch.load(tmp_path / "x" / file, weights_only=True))
    _equal(got, {k: v for k, v in want.items() if k != FROZEN})


DEEPSPEED_FIXTURES = Path(__file__).parent / "fixtures" / "deepspeed_0.19.8"
DSREF = Path("/tmp/dsref/bin/python")


@pytest.mark.parametrize("case", ["zero2_fp32_w2", "zero3_bf16_w2"])
def test_deepspeed_written_checkpoint(case: str, tmp_path: Path) -> None:
    """A checkpoint real DeepSpeed wrote: the same state dict as DeepSpeed's own zero_to_fp32
    (run from /tmp/dsref when present), lazily too, and sharded output from it."""
    from ds_engine.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
        to_torch_tensor,
    )

    folder = DEEPSPEED_FIXTURES / case
    state = get_fp32_state_dict_from_zero_checkpoint(folder)
    assert {k: v.dtype for k, v in state.items()} == dict.fromkeys(state, torch.float32)
    _equal(to_torch_tensor(get_fp32_state_dict_from_zero_checkpoint(folder, lazy_mode=True)), state)
    convert_zero_checkpoint_to_fp32_state_dict(folder, tmp_path / "out", max_shard_size="1KB")
    index = json.loads((tmp_path / "out" / "pytorch_model.bin.index.json").read_text())
    assert set(index["weight_map"]) == set(state)
    if not DSREF.exists():
        pytest.skip("real DeepSpeed (/tmp/dsref) is not installed: compared with ds's reading only")
    script = (
        "import sys, torch; from deepspeed.utils.zero_to_fp32 import "
        "get_fp32_state_dict_from_zero_checkpoint as f; "
        "torch.save(f(sys.argv[1]), sys.argv[2])"
    )
    env = {"DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [str(DSREF), "-c", script, str(folder), str(tmp_path / "ref.pt")],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    _equal(state, torch.load(tmp_path / "ref.pt", weights_only=True))


def _rank0_alone_body(rank: int, world_size: int, folder: str) -> dict | None:
    """Rank 0 alone consolidates while the 2-rank process group exists (``if rank == 0:
    convert_zero_checkpoint_to_fp32_state_dict(...)`` after training): verification must not
    wait for rank 1, which never calls it."""
    import ds_comm
    from ds_engine.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    got = None
    if rank == 0:
        got = get_fp32_state_dict_from_zero_checkpoint(folder, tag="step2")
    ds_comm.barrier()
    return got


def test_one_rank_consolidates_alone_under_a_process_group(saved) -> None:
    folder, want = saved
    got = run_on_ranks(_rank0_alone_body, 2, str(folder), timeout=120)[0]
    _equal(got, want)
