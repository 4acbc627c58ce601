"""``deepspeed.tp_model_init`` on 2 real gloo ranks (tp=2): forward and every gradient equal the
single-process model's (a shard's gradient is the matching slice), merged weights round-trip,
the policy override works and bad shapes fail clearly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_testing import run_on_ranks


class _Attention(nn.Module):
    """Llama-style attention: per-head shapes from ``num_heads``; ``-1`` for the hidden size."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.o_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(att.transpose(1, 2).reshape(b, t, -1))


class _Block(nn.Module):
    def __init__(self, dim: int = 8, heads: int = 4) -> None:
        super().__init__()
        self.self_attn = _Attention(dim, heads)
        self.gate_proj, self.up_proj = nn.Linear(dim, 16, bias=False), nn.Linear(dim, 16)
        self.down_proj = nn.Linear(16, dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 12), nn.GELU(), nn.Linear(12, dim))
        self.lm_head = nn.Linear(dim, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(x)
        x = x + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.lm_head(x + self.ffn(x))


class _Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 6), nn.Linear(6, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(torch.tanh(self.a(x))))


class Conv1D(nn.Module):
    """transformers' GPT-2 ``Conv1D`` as it is: the weight stored ``[in, out]``, ``nf``/``nx``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight)
        return out.view(*x.shape[:-1], self.nf)


class _GPT2Attention(nn.Module):
    """GPT-2's attention: a fused q|k|v ``c_attn`` split by ``split_size``; views with ``-1``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.split_size = heads, dim // heads, dim
        self.c_attn, self.c_proj = Conv1D(3 * dim, dim), Conv1D(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).split(self.split_size, dim=2)
        q, k, v = (y.view(b, t, -1, self.head_dim).transpose(1, 2) for y in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(att.transpose(1, 2).reshape(b, t, -1))


class _GPT2MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(4 * dim, dim), Conv1D(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class _GPT2Block(nn.Module):
    """GPT-2's block: ``c_attn`` fused column, ``c_proj`` row, ``c_fc`` column (all Conv1D)."""

    def __init__(self, dim: int = 8, heads: int = 4) -> None:
        super().__init__()
        self.attn, self.mlp = _GPT2Attention(dim, heads), _GPT2MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class _Phi3Attention(nn.Module):
    """Phi-3's attention: one ``qkv_proj`` of q (4 heads) | k | v (2 key/value heads each); the
    query width read from the (shared) ``config``; per-head views with ``-1``."""

    def __init__(self, dim: int = 8, heads: int = 4, kv_heads: int = 2) -> None:
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads)
        self.head_dim, self.num_key_value_heads = dim // heads, kv_heads
        self.qkv_proj = nn.Linear(dim, (heads + 2 * kv_heads) * (dim // heads), bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv_proj(x)
        q_end = self.config.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        q, k, v = qkv[..., :q_end], qkv[..., q_end : q_end + kv], qkv[..., q_end + kv :]
        q, k, v = (y.view(b, t, -1, self.head_dim).transpose(1, 2) for y in (q, k, v))
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(att.transpose(1, 2).reshape(b, t, -1))


class _GateUp(nn.Module):
    """A Phi-3-style MLP: one fused ``gate_up_proj`` chunked in two."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = nn.Linear(6, 16, bias=False), nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def _grads_and_output(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    out = model(x)
    (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).pow(2).sum().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


def _shard(full: torch.Tensor, param: torch.Tensor, rank: int) -> torch.Tensor:
    """The reference slice of a sharded parameter: every fused part's chunk, concatenated."""
    dim, sections = param.partition_dim, param.fused_sections  # type: ignore[attr-defined]
    parts = full.split(list(sections), dim=dim) if sections else [full]
    return torch.cat([p.chunk(2, dim=dim)[rank] for p in parts], dim=dim)


def _check_parity(make: type[nn.Module], x: torch.Tensor, policy: dict | None = None) -> list[str]:
    import ds_engine as deepspeed
    from ds_engine._autotp_layers import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    reference = make().double()
    model = make().double()
    model.load_state_dict(reference.state_dict())
    full_state = {k: v.clone() for k, v in reference.state_dict().items()}
    ref_out, ref_grads = _grads_and_output(reference, x)
    deepspeed.tp_model_init(model, tp_size=2, dtype=torch.float64, policy=policy)
    out, grads = _grads_and_output(model, x)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    rank = torch.distributed.get_rank()
    for name, param in model.named_parameters():
        expected = ref_grads[name]
        if getattr(param, "tensor_model_parallel", False):
            expected = _shard(expected, param, rank)
        assert grads[name].shape == expected.shape, name
        torch.testing.assert_close(grads[name], expected, rtol=1e-12, atol=1e-12, msg=name)
    merged = deepspeed.gather_tp_state_dict(model)
    assert merged.keys() == full_state.keys()
    for key, value in full_state.items():
        assert torch.equal(merged[key], value), key
    parallel = (ColumnParallelLinear, RowParallelLinear)
    return sorted(
        f"{n}:{type(m).__name__[:3]}" for n, m in model.named_modules() if isinstance(m, parallel)
    )


def _example_gpt_parity() -> list[str]:
    """tools/examples/gpt: its MLPs split (Sequential), its fused qkv and tied head stay whole."""
    import importlib.util
    from pathlib import Path

    import ds_engine as deepspeed

    path = Path(__file__).resolve().parents[3] / "tools" / "examples" / "gpt" / "train.py"
    spec = importlib.util.spec_from_file_location("_example_gpt", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    reference = example.GPT(vocab=16, seq=6, dim=8, layers=2, heads=2).double()
    model = example.GPT(vocab=16, seq=6, dim=8, layers=2, heads=2).double()
    model.load_state_dict(reference.state_dict())
    tokens = torch.randint(0, 16, (2, 7))
    reference(tokens).backward()
    deepspeed.tp_model_init(model, 2, torch.float64)
    loss = model(tokens)
    loss.backward()
    torch.testing.assert_close(loss, reference(tokens), rtol=1e-12, atol=1e-12)
    ref_params = dict(reference.named_parameters())
    rank = torch.distributed.get_rank()
    for name, param in model.named_parameters():
        expected = ref_params[name].grad
        assert expected is not None and param.grad is not None
        if getattr(param, "tensor_model_parallel", False):
            expected = expected.chunk(2, dim=param.partition_dim)[rank]  # type: ignore[attr-defined]
        torch.testing.assert_close(param.grad, expected, rtol=1e-12, atol=1e-12, msg=name)
    return sorted(n for n, p in model.named_parameters() if getattr(p, "tensor_model_parallel", 0))


def _autotp_body(rank: int, world_size: int) -> dict:
    import ds_engine as deepspeed

    torch.manual_seed(1)
    result = {"block": _check_parity(_Block, torch.randn(2, 5, 8, dtype=torch.float64))}
    result["gpt2"] = _check_parity(_GPT2Block, torch.randn(2, 5, 8, dtype=torch.float64))
    result["gate_up"] = _check_parity(_GateUp, torch.randn(3, 6, dtype=torch.float64))
    result["phi3"] = _check_parity(_Phi3Attention, torch.randn(2, 5, 8, dtype=torch.float64))
    result["custom"] = _check_parity(
        _Custom, torch.randn(3, 4, dtype=torch.float64), {"a": "column", "b": "row"}
    )
    torch.manual_seed(0)
    block = deepspeed.tp_model_init(_Block(), 2, torch.float64)
    result["heads"] = block.self_attn.num_heads
    with pytest.raises(ValueError, match=r"'lm_head'.*out_features=5.*tp_size=2"):
        odd = _Block()
        odd.lm_head = nn.Linear(8, 5)
        deepspeed.tp_model_init(odd, 2, torch.float64, policy={"lm_head": "column"})
    with pytest.raises(
        NotImplementedError, match=r"'ffn.0' shares a parameter with 'lm_head'.*tied"
    ):
        tied = _Block()
        tied.ffn[0].weight = tied.lm_head.weight = nn.Parameter(torch.randn(12, 8))
        deepspeed.tp_model_init(tied, 2, torch.float64)
    result["gpt"] = _example_gpt_parity()
    with pytest.raises(ValueError, match="not one of"):
        deepspeed.tp_model_init(_Custom(), 2, torch.float64, policy={"a": "rows"})
    return result


def test_tp2_matches_single_process_and_merges_back() -> None:
    results = run_on_ranks(_autotp_body, 2)
    assert results[0] == results[1]
    assert results[0]["block"] == [
        "down_proj:Row",
        "ffn.0:Col",
        "ffn.2:Row",
        "gate_proj:Col",
        "self_attn.k_proj:Col",
        "self_attn.o_proj:Row",
        "self_attn.q_proj:Col",
        "self_attn.v_proj:Col",
        "up_proj:Col",
    ]
    assert results[0]["custom"] == ["a:Col", "b:Row"]
    assert results[0]["gpt2"] == [
        "attn.c_attn:Col",
        "attn.c_proj:Row",
        "mlp.c_fc:Col",
        "mlp.c_proj:Row",
    ]
    assert results[0]["gate_up"] == ["down_proj:Row", "gate_up_proj:Col"]
    assert results[0]["phi3"] == ["o_proj:Row", "qkv_proj:Col"]
    assert results[0]["heads"] == 2
    assert results[0]["gpt"] == [
        f"blocks.{i}.mlp.{j}.{w}"
        for i in (0, 1)
        for j, w in ((0, "bias"), (0, "weight"), (2, "weight"))
    ]


def test_tp_size_one_only_casts() -> None:
    import ds_engine as deepspeed

    model = deepspeed.tp_model_init(_Custom(), 1, torch.float64)
    assert all(p.dtype == torch.float64 for p in model.parameters())
    assert isinstance(model.a, nn.Linear)


def test_gpt2_conv1d_is_planned_by_name() -> None:
    from ds_engine._autotp import _plan

    model = nn.Module()
    model.c_attn, model.c_proj, model.q_proj = Conv1D(12, 4), Conv1D(4, 4), nn.Linear(4, 4)
    model.other = Conv1D(4, 4)  # an unknown name stays whole
    assert _plan(model, None) == {"c_attn": "qkv", "c_proj": "row", "q_proj": "column"}
    assert _plan(model, {"c_attn": "skip"}) == {"c_proj": "row", "q_proj": "column"}
