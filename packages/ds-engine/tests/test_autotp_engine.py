"""AutoTP training through ``initialize()`` (``tensor_parallel.autotp_size``), on real gloo ranks:
the engine shards an unmodified model over the tp axis of a ParallelGrid, ZeRO runs over the
data-parallel group, and every step's loss, clipped gradient norm and the merged weights equal
the single-process model trained on the whole batch. Checkpoints round-trip and
``save_16bit_model`` writes merged weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_testing import run_on_ranks

DIM, HEADS, SEQ, VOCAB_OUT = 8, 4, 5, 6
CLIP = 0.05  # below every step's norm: each step clipped by a different factor


class _Attention(nn.Module):
    """Llama-style attention: per-head shapes from ``num_heads``; ``-1`` for the hidden size."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.head_dim = HEADS, DIM // HEADS
        self.q_proj, self.k_proj = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM, bias=False)
        self.v_proj, self.o_proj = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(att.transpose(1, 2).reshape(b, t, -1))


class TinyBlock(nn.Module):
    """A plain nn.Module: attention, a gated MLP, a Sequential MLP, a replicated norm and head."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.self_attn = _Attention()
        self.gate_proj, self.up_proj = nn.Linear(DIM, 16, bias=False), nn.Linear(DIM, 16)
        self.down_proj = nn.Linear(16, DIM)
        self.ffn = nn.Sequential(nn.Linear(DIM, 12), nn.GELU(), nn.Linear(12, DIM))
        self.lm_head = nn.Linear(DIM, VOCAB_OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm(x))
        x = x + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.lm_head(x + self.ffn(x))


def make_block(seed: int = 0) -> TinyBlock:
    torch.manual_seed(seed)
    return TinyBlock()


def dataset(rows: int) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(rows, SEQ, DIM, generator=gen)
    return torch.utils.data.TensorDataset(x, torch.randn(rows, SEQ, VOCAB_OUT, generator=gen))


def _config(stage: int, tp: int, micro: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage},
        "tensor_parallel": {"autotp_size": tp},
    }


def _gather_batch(batch: list[torch.Tensor], group) -> list[torch.Tensor]:
    """The data-parallel group's micro-batches joined (in dp-rank order): the global batch."""
    import ds_comm

    size = ds_comm.get_world_size(group)
    out = []
    for t in batch:
        parts = [torch.empty_like(t) for _ in range(size)]
        ds_comm.all_gather(parts, t.contiguous(), group=group)
        out.append(torch.cat(parts))
    return out


def _same_on_tp_peers(tensor: torch.Tensor, group) -> bool:
    import ds_comm

    parts = [torch.empty_like(tensor) for _ in range(ds_comm.get_world_size(group))]
    ds_comm.all_gather(parts, tensor.contiguous(), group=group)
    return all(torch.equal(p, parts[0]) for p in parts)


def _train_body(
    rank: int,
    world_size: int,
    *,
    stage: int,
    tp: int,
    save_dir: str | None = None,
    steps: int = 3,
) -> dict:
    import ds_comm
    import ds_engine
    from ds_engine._autotp_layers import is_tensor_parallel_layer

    micro = 2
    dp = world_size // tp
    data = dataset(micro * dp * (steps + 1))
    engine, _, loader, _ = ds_engine.initialize(
        model=make_block(), config=_config(stage, tp, micro), training_data=data
    )
    assert loader is not None
    assert engine.dp_world_size == dp and engine.mp_world_size == tp
    assert engine.train_batch_size() == micro * dp
    assert engine.get_tensor_parallel_rank() == rank % tp
    split = sorted(n for n, m in engine.module.named_modules() if is_tensor_parallel_layer(m))
    reference = make_block()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    tp_group, dp_group = engine.mpu.get_model_parallel_group(), engine.dp_group
    losses, norms, worst = [], [], 0.0
    batches = iter(loader)
    for _ in range(steps):
        x, y = next(batches)
        assert _same_on_tp_peers(x, tp_group)  # tp peers of one replica read one micro-batch
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        gx, gy = _gather_batch([x, y], dp_group)
        ref_opt.zero_grad()
        ref_loss = F.mse_loss(reference(gx.cpu()), gy.cpu())  # the reference runs on the CPU
        ref_loss.backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP))
        ref_opt.step()
        mean = loss.detach().clone()
        ds_comm.all_reduce(mean, group=dp_group)
        worst = max(worst, abs(mean.item() / dp - ref_loss.item()) / ref_loss.item())
        losses.append(ref_loss.item())
        norms.append((engine.get_global_grad_norm(), ref_norm))
    merged = ds_engine.gather_tp_state_dict(engine.module)
    ref_state = reference.state_dict()
    assert merged.keys() == ref_state.keys()
    for key, value in ref_state.items():
        assert merged[key].shape == value.shape, key
        worst = max(worst, ((merged[key].cpu() - value).abs().max() / value.abs().max()).item())
    result = {"split": split, "worst": worst, "norms": norms}
    if save_dir is not None:
        result["checkpoint"] = _checkpoint_round_trip(engine, batches, save_dir, stage, tp, micro)
        # zero_to_fp32 merges every tp rank's zero_mp folder (collective under a process
        # group: ds-zero verifies the files in shares)
        from ds_engine.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        fp32 = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="t")
        result["zero_to_fp32"] = fp32.keys() == merged.keys() and all(
            torch.equal(fp32[k], merged[k]) for k in merged
        )
        engine.save_16bit_model(save_dir, "merged.bin")
        merged = ds_engine.gather_tp_state_dict(engine.module)  # after the round trip's step
        if rank == 0:
            saved = torch.load(Path(save_dir) / "merged.bin", weights_only=True)
            result["merged_file"] = all(torch.equal(saved[k], merged[k]) for k in merged)
            result["merged_keys"] = saved.keys() == ref_state.keys()
    return result


def _checkpoint_round_trip(engine, batches, save_dir: str, stage: int, tp: int, micro: int):
    """Save, load into a fresh engine (another init), then both take the same step: equal."""
    import ds_engine

    engine.save_checkpoint(save_dir, tag="t")
    other, *_ = ds_engine.initialize(model=make_block(seed=7), config=_config(stage, tp, micro))
    path, _ = other.load_checkpoint(save_dir, tag="t")
    assert path is not None and other.global_steps == engine.global_steps
    x, y = next(batches)
    for e in (engine, other):
        e.backward(F.mse_loss(e(x), y))
        e.step()
    mine = dict(other.module.named_parameters())
    return max(
        (p.detach() - mine[n].detach()).abs().max().item()
        for n, p in engine.module.named_parameters()
    )


_SPLIT = [
    "down_proj",
    "ffn.0",
    "ffn.2",
    "gate_proj",
    "self_attn.k_proj",
    "self_attn.o_proj",
    "self_attn.q_proj",
    "self_attn.v_proj",
    "up_proj",
]


def _check(results: list[dict]) -> None:
    for result in results:
        assert result["split"] == _SPLIT
        assert result["worst"] < 2e-5, result["worst"]
        for norm, ref in result["norms"]:
            assert norm > CLIP and abs(norm - ref) <= 1e-5 * ref, result["norms"]


def test_tp2_zero1_matches_single_process_and_checkpoints(tmp_path: Path) -> None:
    """tp=2 on 2 ranks, ZeRO-1, clipped: parity; checkpoint round trip; merged 16-bit file."""
    results = run_on_ranks(_train_body, 2, stage=1, tp=2, save_dir=str(tmp_path), timeout=300)
    _check(results)
    assert all(r["checkpoint"] == 0.0 for r in results), [r["checkpoint"] for r in results]
    assert results[0]["merged_file"] and results[0]["merged_keys"]
    assert results[0]["zero_to_fp32"]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2])
def test_tp2_matches_single_process_at_stage(stage: int) -> None:
    _check(run_on_ranks(_train_body, 2, stage=stage, tp=2, timeout=300))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_tp2_dp2_matches_single_process(stage: int, tmp_path: Path) -> None:
    """4 ranks: tp=2 x dp=2; ZeRO over the dp group; checkpoints round-trip."""
    results = run_on_ranks(_train_body, 4, stage=stage, tp=2, save_dir=str(tmp_path), timeout=400)
    _check(results)
    assert all(r["checkpoint"] == 0.0 for r in results)
    assert results[0]["merged_file"] and results[0]["zero_to_fp32"]


def _refusal_body(rank: int, world_size: int) -> list[str]:
    import ds_engine

    errors = []
    for cfg, exc in (
        ({**_config(3, 2, 2)}, NotImplementedError),
        ({**_config(1, 3, 2)}, ds_engine.ConfigError),
        ({**_config(1, 2, 2), "tensor_parallel": {"autotp_size": 2, "dtype": "bf16"}}, Exception),
    ):
        with pytest.raises(exc) as info:
            ds_engine.initialize(model=make_block(), config=cfg)
        errors.append(str(info.value))
    import ds_comm

    with pytest.raises(ds_engine.ConfigError) as info:  # an mpu of another tp size
        ds_engine.initialize(
            model=make_block(), config=_config(1, 2, 2), mpu=ds_comm.ParallelGrid(tp=1).mpu()
        )
    errors.append(str(info.value))
    # DeepSpeed's order: tp_model_init first, then initialize with the config: kept as sharded
    model = ds_engine.tp_model_init(make_block(), 2, torch.float32)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    engine, *_ = ds_engine.initialize(model=model, config=_config(1, 2, 2))
    assert engine.module is model
    assert {n: p.shape for n, p in engine.module.named_parameters()} == shapes
    x, y = dataset(2).tensors
    engine.backward(F.mse_loss(engine(x), y))
    engine.step()
    other, *_ = ds_engine.initialize(model=make_block(), config=_config(1, 2, 2))
    with pytest.raises(RuntimeError) as info:  # tp peers fed different batches
        other(x + rank)
    errors.append(str(info.value))
    import ds_moe

    def moe_model() -> nn.Module:
        expert = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        return nn.Sequential(nn.Linear(DIM, DIM), ds_moe.MoE(DIM, expert, num_experts=2, k=1))

    with pytest.raises(NotImplementedError) as info:  # AutoTP with MoE: no parity shown
        ds_engine.initialize(model=moe_model(), config=_config(1, 2, 2))
    errors.append(str(info.value))
    with pytest.raises(NotImplementedError) as info:
        ds_engine.tp_model_init(moe_model(), 2, torch.float32)
    errors.append(str(info.value))
    return errors


def test_refusals_name_the_key_and_a_tp_model_init_model_is_kept() -> None:
    errors = run_on_ranks(_refusal_body, 2, timeout=120)[0]
    assert "zero_optimization.stage 3" in errors[0] and "autotp_size = 2" in errors[0]
    assert "autotp_size = 3 does not divide the world size 2" in errors[1]
    assert "tensor_parallel.dtype = 'bf16' conflicts" in errors[2]
    assert "model-parallel group has 1 ranks" in errors[3]
    assert "given different inputs in their first forward" in errors[4]
    for error in errors[5:]:  # names both features
        assert "tensor_parallel.autotp_size" in error and "MoE" in error, error
        assert "'1' is a deepspeed.moe.layer.MoE" in error and "not implemented" in error


def test_unimplemented_tensor_parallel_keys_stay_refused() -> None:
    from ds_engine import ConfigError, DeepSpeedConfig

    DeepSpeedConfig.from_dict({"train_batch_size": 2, "tensor_parallel": {"autotp_size": 2}})
    with pytest.raises(ConfigError, match=r"tensor_parallel.*tp_overlap_comm.*not implemented"):
        DeepSpeedConfig.from_dict(
            {"train_batch_size": 2, "tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": True}}
        )
