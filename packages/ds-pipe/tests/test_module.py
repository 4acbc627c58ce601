"""PipelineModule on 1, 2 and 4 gloo ranks: each stage builds only its layers, a hand-driven
pipeline pass equals the single-process model (outputs and gradients, tied weights included),
virtual stages, 3D topologies, the printed partition and the errors."""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
import _pipe_models as pm

from ds_comm import PipeDataParallelTopology, PipeModelDataParallelTopology, ProcessTopology
from ds_pipe import LayerSpec, PipelineModule


class CountingBlock(pm.MLPBlock):
    """An MLPBlock that records the device type of every weight it allocates."""

    devices: list[str] = []

    def __init__(self, dim: int = pm.MLP_DIM) -> None:
        super().__init__(dim)
        CountingBlock.devices.append(self.linear.weight.device.type)


def _build_only_owned_body(rank: int, world_size: int, num_stages: int, method: str) -> None:
    CountingBlock.devices = []
    layers = [LayerSpec(nn.Linear, pm.MLP_IN, pm.MLP_DIM)]
    layers += [LayerSpec(CountingBlock) for _ in range(7)]
    with contextlib.redirect_stdout(io.StringIO()):
        model = PipelineModule(layers, num_stages=num_stages, partition_method=method)
    lo, hi = model.parts[model.stage_id], model.parts[model.stage_id + 1]
    owned_blocks = len([i for i in range(lo, hi) if i >= 1])
    assert CountingBlock.devices.count("cpu") == owned_blocks  # only owned layers allocate
    # counting parameters (partition, rank 0's table) builds on the meta device only
    meta_builds = (7 if method == "parameters" else 0) + (7 if rank == 0 else 0)
    assert CountingBlock.devices.count("meta") == meta_builds
    built = {int(name.split(".")[0]) for name, _ in model.named_parameters()}
    assert built == set(range(lo, hi))
    expected_params = sum(p.numel() for i in range(lo, hi) for p in layers[i].build().parameters())
    assert sum(p.numel() for p in model.parameters()) == expected_params
    assert model.num_stages == num_stages and model.stage_id == rank // (world_size // num_stages)


@pytest.mark.parametrize(
    ("world_size", "num_stages", "method"),
    [(1, 1, "parameters"), (2, 2, "uniform"), (4, 4, "parameters")],
)
def test_each_stage_builds_only_its_layers(world_size: int, num_stages: int, method: str) -> None:
    run_on_ranks(_build_only_owned_body, world_size, num_stages, method)


def _parity_body(rank: int, world_size: int, model_name: str, num_stages: int) -> dict:
    torch.manual_seed(100 + rank)  # unseeded state differs per rank: seed_layers must win
    layers = pm.mlp_layers() if model_name == "mlp" else pm.transformer_layers()
    loss_fn = pm.mse_loss if model_name == "mlp" else pm.lm_loss
    with contextlib.redirect_stdout(io.StringIO()):
        model = PipelineModule(layers, num_stages=num_stages, loss_fn=loss_fn, seed_layers=True)
    reference = pm.build_reference(layers)
    assert pm.max_param_error(model, reference, grads=False) == 0.0
    data_rank = model.grid.axis_rank("data")
    batch = pm.mlp_batch(6, seed=data_rank) if model_name == "mlp" else pm.lm_batch(3, data_rank)
    outs = pm.boundary_outputs(reference, batch[0])
    loss = pm.run_micro_batch(model, *batch, loss_fn, outs)
    ref_loss = loss_fn(reference(batch[0]), batch[1])
    ref_loss.backward()
    assert abs(loss - float(ref_loss)) <= 1e-6 * max(1.0, abs(float(ref_loss)))
    grad_error = pm.max_param_error(model, reference, grads=True)
    assert grad_error < 1e-5, grad_error
    return {"loss": loss, "grad_error": grad_error}


@pytest.mark.parametrize(
    ("model_name", "world_size", "num_stages"),
    [
        ("mlp", 1, 1),
        ("mlp", 4, 2),  # 2 stages x 2 data-parallel replicas
        ("transformer", 1, 1),  # both tied uses on one stage
        ("transformer", 2, 2),
        ("transformer", 4, 4),
    ],
)
def test_pipeline_pass_matches_the_sequential_model(
    model_name: str, world_size: int, num_stages: int
) -> None:
    results = run_on_ranks(_parity_body, world_size, model_name, num_stages)
    assert len({round(r["loss"], 6) for r in results}) == world_size // num_stages


def _tied_body(rank: int, world_size: int) -> None:
    torch.manual_seed(rank)  # no seed_layers: each stage initialises its copy differently
    with contextlib.redirect_stdout(io.StringIO()):
        model = PipelineModule(pm.transformer_layers(), num_stages=2, loss_fn=pm.lm_loss)
    groups = model.tied_groups()
    assert list(groups) == ["embed"]
    tied = groups["embed"]
    # one tie group per pipeline replica: rank = stage * data_parallel_size + data_rank
    expected_ranks = {2: [0, 1], 4: [0, 2] if rank % 2 == 0 else [1, 3]}[world_size]
    assert tied.ranks == expected_ranks and tied.weight_attrs == ["weight"]
    weight = tied.params()[0]
    assert weight is model.tied_modules["embed"].weight
    gathered = [torch.empty_like(weight) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, weight.detach())
    for other in tied.ranks:  # broadcast from the lowest stage at construction
        assert torch.equal(gathered[other], gathered[tied.ranks[0]])
    elsewhere = model.tied_params_owned_elsewhere()
    if rank == tied.ranks[0]:
        assert elsewhere == [] and not hasattr(weight, "ds_pipe_replicated")
    else:
        assert elsewhere == [weight] and weight.ds_pipe_replicated
    assert model.tied_comms["embed"]["module"] is model.tied_modules["embed"]
    # gradients are summed over the tie group
    weight.grad = torch.full_like(weight, float(rank + 1))
    model.allreduce_tied_weight_gradients()
    assert torch.all(weight.grad == float(sum(r + 1 for r in tied.ranks)))


@pytest.mark.parametrize("world_size", [2, 4])
def test_tied_weights_are_broadcast_and_their_grads_summed(world_size: int) -> None:
    run_on_ranks(_tied_body, world_size)


def test_tied_layers_on_one_stage_share_one_module() -> None:
    run_on_ranks(_tied_one_stage_body, 1)


def _tied_one_stage_body(rank: int, world_size: int) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        model = PipelineModule(pm.transformer_layers(1), num_stages=1)
    embeds = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    assert len(embeds) == 1 and model.tied_groups()["embed"].ranks == [0]
    assert model.tied_params_owned_elsewhere() == []


def _seed_fn_body(rank: int, world_size: int) -> list[int]:
    seeds: list[int] = []
    layers = [
        pm.TiedLayerSpec("embed", nn.Embedding, pm.VOCAB, pm.MODEL_DIM),
        LayerSpec(nn.Linear, pm.MODEL_DIM, pm.MODEL_DIM),
        lambda x: x * 2,  # a plain lambda is a weightless layer
        LayerSpec(nn.Linear, pm.MODEL_DIM, pm.MODEL_DIM),
        pm.TiedLayerSpec("embed", nn.Embedding, pm.VOCAB, pm.MODEL_DIM, forward_fn=pm.unembed),
    ]
    with contextlib.redirect_stdout(io.StringIO()):
        model = PipelineModule(
            layers,
            num_stages=2,
            seed_layers=True,
            seed_fn=seeds.append,
            base_seed=10,
            partition_method=[0, 3, 5],
        )
    ids = pm.lm_batch(2)[0]
    x = model.tied_modules["embed"](ids) if rank == 1 else ids
    assert model(x).shape == ((2, pm.SEQ, pm.MODEL_DIM) if rank == 0 else (2, pm.SEQ, pm.VOCAB))
    return seeds


def test_seed_fn_gets_base_seed_plus_layer_index() -> None:
    # the tied module on stage 1 is seeded as its key's first occurrence (layer 0) is
    assert run_on_ranks(_seed_fn_body, 2) == [[10, 11], [13, 10]]


def _virtual_body(rank: int, world_size: int) -> None:
    layers = pm.mlp_layers(num_blocks=6)  # 9 layers in 4 chunks
    with contextlib.redirect_stdout(io.StringIO()):
        model = PipelineModule(
            layers, num_stages=2, num_virtual_stages=2, partition_method="uniform", seed_layers=True
        )
    assert model.parts == [0, 3, 5, 7, 9]
    assert model.chunk_ids() == [rank, rank + 2]
    assert [model.stage_owner(i) for i in range(9)] == [0, 0, 0, 1, 1, 0, 0, 1, 1]
    built = sorted({int(n.split(".")[0]) for n, _ in model.named_parameters()})
    assert built == ([0, 1, 5, 6] if rank == 0 else [3, 4, 7, 8])  # layer 2 is a callable
    reference = pm.build_reference(layers)
    x, _ = pm.mlp_batch(4)
    outs = pm.boundary_outputs(reference, x)
    for chunk in range(4):
        if chunk % 2 != rank:
            continue
        if chunk == 0:
            inp = x
        else:
            inp = torch.empty_like(outs[model.parts[chunk] - 1])
            torch.distributed.recv(inp, src=1 - rank)
        out = model(inp, chunk_id=chunk)
        torch.testing.assert_close(out, outs[model.parts[chunk + 1] - 1], rtol=1e-6, atol=1e-6)
        if chunk < 3:
            torch.distributed.send(out.detach(), dst=1 - rank)
    with pytest.raises(ValueError, match="pass chunk_id="):
        model(x)
    with pytest.raises(ValueError, match=f"chunk_id=5 is not on stage {rank}"):
        model(x, chunk_id=5)


def test_virtual_stages_own_interleaved_chunks() -> None:
    run_on_ranks(_virtual_body, 2)


def _topology_body(rank: int, world_size: int) -> None:
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
    with contextlib.redirect_stdout(io.StringIO()):
        model = PipelineModule(pm.mlp_layers(), topology=topo, partition_method="uniform")
    assert model.topology() is topo and model._topo is topo
    assert model.grid is model._grid and model.stage_id == rank // 2
    mpu = model.mpu()
    assert mpu.get_model_parallel_world_size() == 2 and mpu.get_data_parallel_world_size() == 1
    assert mpu.get_model_parallel_rank() == rank % 2
    assert model.ckpt_layer_path("/ck", 0).endswith(
        f"layer_{model.parts[model.stage_id]:02d}-model_{rank % 2:02d}-model_states.pt"
    )
    assert model.grid.next_stage_rank == (rank + 2 if rank < 2 else None)


def test_pipe_model_data_topology() -> None:
    run_on_ranks(_topology_body, 4)


def _table_body(rank: int, world_size: int) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        PipelineModule(pm.mlp_layers(), num_stages=2, loss_fn=pm.mse_loss)
    return out.getvalue()


def test_partition_table_is_printed_once_by_rank_0() -> None:
    text, other = run_on_ranks(_table_body, 2)
    assert other == ""
    lines = text.splitlines()
    assert lines[0].startswith("Pipeline partition: 9 layers on 2 stages, method='parameters'")
    assert "callable scale_half" in text and lines[-1] == "loss: mse_loss"


def _errors_body(rank: int, world_size: int) -> None:
    quiet = contextlib.redirect_stdout(io.StringIO())
    with quiet, pytest.raises(ValueError, match="num_stages=3 does not divide the world size 4"):
        PipelineModule(pm.mlp_layers(), num_stages=3)
    with quiet, pytest.raises(ValueError, match="3 layers cannot fill 4 pipeline parts"):
        PipelineModule([LayerSpec(nn.Linear, 2, 2)] * 3, num_stages=4)
    with quiet, pytest.raises(ValueError, match="9 layers cannot fill 16 pipeline parts"):
        PipelineModule(pm.mlp_layers(), num_stages=4, num_virtual_stages=4)
    with quiet, pytest.raises(ValueError, match="has no 'pipe' axis"):
        PipelineModule(pm.mlp_layers(), topology=ProcessTopology(["data"], [4]))
    with quiet, pytest.raises(ValueError, match="num_stages=4 but the topology has 2 pipe"):
        PipelineModule(pm.mlp_layers(), num_stages=4, topology=PipeDataParallelTopology(2, 2))
    with quiet, pytest.raises(ValueError, match="needs num_stages or topology"):
        PipelineModule(pm.mlp_layers())
    with quiet, pytest.raises(ValueError, match="partition_method='params' is not supported"):
        PipelineModule(pm.mlp_layers(), num_stages=2, partition_method="params")
    with quiet, pytest.raises(TypeError, match=r"layers\[1\] = 3 \(int\) is not a LayerSpec"):
        PipelineModule([LayerSpec(nn.Linear, 2, 2), 3], num_stages=1)
    with quiet, pytest.raises(ValueError, match="activation_checkpoint_interval=-1"):
        PipelineModule(pm.mlp_layers(), num_stages=2, activation_checkpoint_interval=-1)
    with quiet, pytest.raises(AttributeError, match="tied_weight_attr 'wieght'"):
        PipelineModule(
            [pm.TiedLayerSpec("e", nn.Embedding, 4, 4, tied_weight_attr="wieght")], num_stages=1
        )


def test_errors_name_the_value_and_the_fix() -> None:
    run_on_ranks(_errors_body, 4)


def _no_group_body(rank: int, world_size: int) -> None:
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match=r"call ds_comm\.init_distributed"):
        PipelineModule(pm.mlp_layers(), num_stages=1)


def test_a_process_group_is_required() -> None:
    run_on_ranks(_no_group_body, 1, init_process_group=False, fresh=True)


def _nccl_body(rank: int, world_size: int) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        model = PipelineModule(pm.transformer_layers(), num_stages=1, seed_layers=True)
    assert all(p.is_cuda for p in model.parameters())
    reference = pm.build_reference(pm.transformer_layers()).cuda()
    ids = pm.lm_batch(2)[0].cuda()
    torch.testing.assert_close(model(ids), reference(ids))


@pytest.mark.gpu(1)
def test_nccl_moves_the_stage_to_its_gpu() -> None:
    run_on_ranks(_nccl_body, 1, backend="nccl")
