"""A tiny causal attention LM for the sequence-parallel tests and benchmark: the same module runs
SP=1 (torch SDPA on the whole sequence) or SP=P (the attention wrapped in Ulysses'
``DistributedAttention`` over a sequence group)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[b, s, h, d]`` causal attention."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


class TinyAttentionLM(nn.Module):
    """Embedding + position embedding, one causal self-attention block with an MLP, a head."""

    def __init__(
        self, vocab: int = 16, dim: int = 16, heads: int = 4, max_len: int = 64, group: Any = None
    ) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, vocab)
        self.attention: Any = causal_sdpa
        if group is not None:
            from ds_engine.sequence.layer import DistributedAttention

            self.attention = DistributedAttention(causal_sdpa, group, gather_idx=1)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos(position_ids)
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads) for t in self.qkv(x).chunk(3, -1))
        x = x + self.proj(self.attention(q, k, v).reshape(b, s, d))
        x = x + self.mlp(x)
        return self.head(x)


def token_loss(logits: torch.Tensor, shift_labels: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Mean next-token cross-entropy over the labelled tokens, and their count."""
    loss = F.cross_entropy(logits.flatten(0, 1).float(), shift_labels.flatten(), ignore_index=-100)
    return loss, (shift_labels != -100).sum()


def make_sample(seed: int, seq: int, vocab: int = 16, prompt: int = 0) -> dict[str, torch.Tensor]:
    """One ``[1, seq]`` sample: ids, positions, labels (the first ``prompt`` masked)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, seq), generator=gen)
    labels = ids.clone()
    labels[:, :prompt] = -100
    return {"input_ids": ids, "position_ids": torch.arange(seq).unsqueeze(0), "labels": labels}


def full_loss(model: nn.Module, sample: dict[str, torch.Tensor]) -> torch.Tensor:
    """SP=1: the sample's loss over its whole sequence."""
    shift = F.pad(sample["labels"], (0, 1), value=-100)[:, 1:]
    return token_loss(model(sample["input_ids"], sample["position_ids"]), shift)[0]


class LlamaAttentionLM(nn.Module):
    """Llama-style names (``q/k/v/o_proj``, ``num_heads``; ``gate/up/down_proj``) that AutoTP
    shards, with the attention call replaceable by ``DistributedAttention``."""

    def __init__(self, vocab: int = 16, dim: int = 16, heads: int = 8, max_len: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.num_heads, self.head_dim = heads, dim // heads
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.o_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.gate_proj, self.up_proj = nn.Linear(dim, 2 * dim), nn.Linear(dim, 2 * dim)
        self.down_proj = nn.Linear(2 * dim, dim)
        self.lm_head = nn.Linear(dim, vocab)
        self.attention: Any = causal_sdpa

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos(position_ids)
        b, s, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, s, self.num_heads, self.head_dim)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        x = x + self.o_proj(self.attention(q, k, v).reshape(b, s, -1))
        x = x + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.lm_head(x)
