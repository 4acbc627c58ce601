"""Per-layer checkpoints: saved by 4 stages (or 2 stages x 2 replicas), loaded by 2 stages and
into a plain module list; tied layers stored once; only data-parallel rank 0 writes;
model-parallel ranks write their own files; missing files are named."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
import _pipe_models as pm

from ds_comm import PipeModelDataParallelTopology
from ds_pipe import LayerSpec, PipelineModule, layer_checkpoint_name, load_layers_into


def _trained_reference() -> pm.Reference:
    """The transformer reference with every parameter moved off its initial value."""
    reference = pm.build_reference(pm.transformer_layers())
    with torch.no_grad():
        for i, param in enumerate(reference.parameters()):
            param.add_(0.01 * (i + 1))
    return reference


def _copy_from(model: PipelineModule, reference: nn.Module) -> None:
    ref = dict(reference.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(ref[pm.reference_name(name)])


def _build(num_stages: int, base_seed: int, **kwargs: Any) -> PipelineModule:
    with contextlib.redirect_stdout(io.StringIO()):
        return PipelineModule(
            pm.transformer_layers(),
            num_stages=num_stages,
            seed_layers=True,
            base_seed=base_seed,
            **kwargs,
        )


def _save_body(rank: int, world_size: int, ckpt_dir: str, num_stages: int) -> None:
    model = _build(num_stages, base_seed=1)
    _copy_from(model, _trained_reference())
    if model.grid.axis_rank("data") != 0:
        with torch.no_grad():  # a replica that diverged must not be the one written
            for param in model.parameters():
                param.add_(100.0)
    model.save_state_dict(ckpt_dir)
    torch.distributed.barrier()


def _load_body(rank: int, world_size: int, ckpt_dir: str) -> float:
    model = _build(world_size, base_seed=2)
    reference = _trained_reference()
    assert pm.max_param_error(model, reference, grads=False) > 0.01  # different before loading
    model.load_state_dir(ckpt_dir)
    error = pm.max_param_error(model, reference, grads=False)
    assert error == 0.0, error
    ids, _ = pm.lm_batch(2)
    outs = pm.boundary_outputs(reference, ids)
    start = model.parts[model.stage_id]
    inp = ids if start == 0 else outs[start - 1]
    torch.testing.assert_close(model(inp), outs[model.parts[model.stage_id + 1] - 1])
    return error


@pytest.mark.parametrize(("save_ranks", "save_stages"), [(4, 4), (4, 2)])
def test_save_with_one_stage_count_load_with_another_and_into_plain_modules(
    tmp_path: Path, save_ranks: int, save_stages: int
) -> None:
    ckpt = str(tmp_path)
    run_on_ranks(_save_body, save_ranks, ckpt, save_stages)
    names = sorted(os.listdir(tmp_path))
    # 7 layers: the tied unembedding (layer 6) is stored once, as layer 0
    assert names == [layer_checkpoint_name(i) for i in range(6)]
    run_on_ranks(_load_body, 2, ckpt)
    # a plain module list lined up with `layers`: the tied module repeats at index 6
    plain = pm.build_reference(pm.transformer_layers(), base_seed=3)
    modules: list[Any] = [plain.tied["embed"], *(plain.layers[str(i)] for i in range(1, 6))]
    modules.append(plain.tied["embed"])
    assert load_layers_into(modules, ckpt) == [0, 1, 2, 3, 4, 5]
    reference = _trained_reference()
    for (name, mine), theirs in zip(plain.named_parameters(), reference.parameters()):
        assert torch.equal(mine, theirs), name


def _mlp_layers() -> list[Any]:
    return [
        LayerSpec(nn.Linear, pm.MLP_IN, pm.MLP_DIM),
        LayerSpec(nn.ReLU),
        LayerSpec(nn.Linear, pm.MLP_DIM, pm.MLP_DIM),
        torch.tanh,
        LayerSpec(nn.Linear, pm.MLP_DIM, pm.MLP_OUT),
    ]


def _mlp_save_body(rank: int, world_size: int, ckpt_dir: str) -> torch.Tensor:
    with contextlib.redirect_stdout(io.StringIO()):
        model = PipelineModule(_mlp_layers(), num_stages=2, seed_layers=True)
    model.save_state_dict(ckpt_dir)
    torch.distributed.barrier()
    return pm.build_reference(_mlp_layers())(pm.mlp_batch(3)[0]).detach()


def test_load_into_nn_sequential(tmp_path: Path) -> None:
    want = run_on_ranks(_mlp_save_body, 2, str(tmp_path))[0]
    assert layer_checkpoint_name(1) in os.listdir(tmp_path)  # ReLU: an empty state, as DeepSpeed
    assert layer_checkpoint_name(3) not in os.listdir(tmp_path)  # the callable has no file
    torch.manual_seed(5)
    plain = nn.Sequential(
        nn.Linear(pm.MLP_IN, pm.MLP_DIM),
        nn.ReLU(),
        nn.Linear(pm.MLP_DIM, pm.MLP_DIM),
        nn.Tanh(),  # no file and no state: skipped
        nn.Linear(pm.MLP_DIM, pm.MLP_OUT),
    )
    assert load_layers_into(plain, tmp_path) == [0, 1, 2, 4]
    torch.testing.assert_close(plain(pm.mlp_batch(3)[0]), want, rtol=0, atol=0)


def _model_parallel_body(rank: int, world_size: int, ckpt_dir: str) -> list[str]:
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
    model = _build_topo(topo, 1)
    model_rank = model.mpu().get_model_parallel_rank()
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float(model_rank))  # model-parallel ranks hold different shards
    model.save_state_dict(ckpt_dir)
    torch.distributed.barrier()
    other = _build_topo(topo, 2)
    other.load_state_dir(ckpt_dir)
    assert all(torch.all(p == float(model_rank)) for p in other.parameters())
    return sorted(os.listdir(ckpt_dir))


def _build_topo(topo: Any, base_seed: int) -> PipelineModule:
    with contextlib.redirect_stdout(io.StringIO()):
        return PipelineModule(
            pm.transformer_layers(), topology=topo, seed_layers=True, base_seed=base_seed
        )


def test_model_parallel_ranks_write_their_own_files(tmp_path: Path) -> None:
    names = run_on_ranks(_model_parallel_body, 4, str(tmp_path))[0]
    assert names == sorted(
        layer_checkpoint_name(i, f"model_{m:02d}") for i in range(6) for m in range(2)
    )


def _missing_body(rank: int, world_size: int, ckpt_dir: str) -> None:
    model = _build(2, base_seed=1)
    first = model.parts[rank]  # the stage's first layer is the first file it looks for
    with pytest.raises(FileNotFoundError, match=rf"layer_0{first}-model_states.pt' does not"):
        model.load_state_dir(ckpt_dir)


def test_missing_layer_file_is_named(tmp_path: Path) -> None:
    run_on_ranks(_missing_body, 2, str(tmp_path))
