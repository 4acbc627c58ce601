"""Per-expert checkpoint files: names, who writes what, and resharding between ep sizes on real
ranks (a pyramid model whose two MoE layers have 4 and 8 experts)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import ds_moe
from ds_testing import run_on_ranks

HIDDEN = 6


def _pyramid(ep_size: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    expert = nn.Sequential(nn.Linear(HIDDEN, 12), nn.ReLU(), nn.Linear(12, HIDDEN))
    model = nn.ModuleDict(
        {
            "embed": nn.Linear(HIDDEN, HIDDEN),
            "moe1": ds_moe.MoE(HIDDEN, expert, num_experts=4, ep_size=ep_size, k=1),
            "moe2": ds_moe.MoE(HIDDEN, expert, num_experts=8, ep_size=ep_size, use_residual=True),
        }
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    return model.eval()


def _forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    h = model["embed"](x)
    h = model["moe1"](h)[0]
    return model["moe2"](h)[0]


def _reference() -> nn.Module:
    return _pyramid(ep_size=1, seed=0)  # all experts in one process


def _save_body(rank: int, world_size: int, *, ep_size: int, path: str) -> list[str]:
    import ds_comm

    model = _pyramid(ep_size, seed=1)
    groups = ds_moe.configure_expert_parallelism(model)
    full = _reference().state_dict()
    model.load_state_dict(ds_moe.expert_parallel_state_dict(model, full, groups))
    # each held expert parameter's global name is its name in the ep_size=1 model
    names = ds_moe.global_expert_names(model, groups)
    state = model.state_dict()
    assert set(names) == {k for k in state if ".deepspeed_experts." in k}
    assert all(torch.equal(state[local], full[name]) for local, name in names.items())
    written = ds_moe.save_moe_checkpoint(model, path, groups=groups)
    ds_comm.barrier()
    return sorted(os.path.basename(p) for p in written)


def _load_body(rank: int, world_size: int, *, ep_size: int, path: str) -> None:
    model = _pyramid(ep_size, seed=2)
    groups = ds_moe.configure_expert_parallelism(model)
    result = ds_moe.load_moe_checkpoint(model, path, groups=groups)
    assert not result.missing_keys and not result.unexpected_keys

    reference = _reference()
    expected = ds_moe.expert_parallel_state_dict(model, reference.state_dict(), groups)
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), key
    x = torch.randn(10, HIDDEN, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        torch.testing.assert_close(_forward(model, x), _forward(reference, x))


def _expert_files(num_experts: int, layer: int) -> list[str]:
    return [ds_moe.expert_checkpoint_name(layer, e) for e in range(num_experts)]


@pytest.mark.parametrize(
    ("save_world", "save_ep", "load_world", "load_ep"),
    [
        pytest.param(2, 2, 1, 1, id="ep2-to-ep1"),
        pytest.param(1, 1, 2, 2, id="ep1-to-ep2"),
        pytest.param(4, 2, 4, 4, id="ep2-replicated-to-ep4", marks=pytest.mark.slow),
    ],
)
def test_reshard_between_ep_sizes(
    tmp_path, save_world: int, save_ep: int, load_world: int, load_ep: int
) -> None:
    path = str(tmp_path / "step1")
    written = run_on_ranks(_save_body, save_world, ep_size=save_ep, path=path)

    all_files = sorted([ds_moe.model_checkpoint_name(), *_expert_files(4, 0), *_expert_files(8, 1)])
    assert sorted(os.listdir(path)) == all_files
    assert sorted(f for files in written for f in files) == all_files  # each written once
    writers = [rank for rank, files in enumerate(written) if files]
    assert writers == list(range(save_ep))  # expert-data-parallel rank 0 of each expert
    run_on_ranks(_load_body, load_world, ep_size=load_ep, path=path)


def test_file_names_are_deepspeeds() -> None:
    assert ds_moe.expert_checkpoint_name(3, 17, 1) == "layer_3_expert_17_mp_rank_01_model_states.pt"
    assert ds_moe.model_checkpoint_name() == "mp_rank_00_model_states.pt"


def test_expert_file_holds_one_expert_under_its_global_id(tmp_path) -> None:
    model = _reference()
    ds_moe.save_moe_checkpoint(model, tmp_path)
    saved = torch.load(tmp_path / ds_moe.expert_checkpoint_name(1, 5), weights_only=True)
    prefix = "moe2.deepspeed_moe.experts.deepspeed_experts.5."
    assert sorted(saved) == sorted(prefix + s for s in ("0.weight", "0.bias", "2.weight", "2.bias"))
    assert torch.equal(
        saved[prefix + "0.weight"],
        model["moe2"].deepspeed_moe.experts.deepspeed_experts[5][0].weight,
    )
    dense = torch.load(tmp_path / ds_moe.model_checkpoint_name(), weights_only=True)["module"]
    assert not any(".deepspeed_experts." in key for key in dense)
    assert "moe2.deepspeed_moe.gate.wg.weight" in dense and "moe2.coefficient.weight" in dense


def test_load_names_missing_expert_file(tmp_path) -> None:
    ds_moe.save_moe_checkpoint(_reference(), tmp_path)
    os.remove(tmp_path / ds_moe.expert_checkpoint_name(1, 6))
    with pytest.raises(FileNotFoundError, match="no checkpoint of expert 6 of MoE layer 1"):
        ds_moe.load_moe_checkpoint(_reference(), tmp_path)
