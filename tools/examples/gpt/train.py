"""Train a small GPT with ds-engine on a built-in synthetic language, and watch the loss fall.

The language is learnable and needs no download: every sequence counts upwards from a random
token with a random stride (``t[i+1] = t[i] + stride mod vocab``), so after two tokens the rest
is predictable; the loss falls from ln(vocab) towards zero. The loop is DeepSpeed's, written
against ``import ds_engine as deepspeed``; the config chooses ZeRO stage, precision and offload.

Two local CPU ranks (see README.md for the one-line command from a fresh machine)::

    uv run ds-launch --num_gpus 2 tools/examples/gpt/train.py \\
        --deepspeed_config tools/examples/gpt/configs/zero2.json

One process::

    uv run python tools/examples/gpt/train.py \\
        --deepspeed_config tools/examples/gpt/configs/zero0.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import ds_engine as deepspeed


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a head tied to the token embedding.

    ``forward(tokens)`` returns the mean next-token cross-entropy of ``tokens`` (batch, seq + 1).
    """

    def __init__(self, vocab: int, seq: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2's init: small weights keep the tied head's first logits near uniform.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = self.tok(inputs) + self.pos(torch.arange(inputs.shape[1], device=inputs.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class CountingLanguage(torch.utils.data.Dataset):
    """``size`` sequences of ``seq + 1`` tokens: a random start, then a fixed random stride."""

    def __init__(self, size: int, vocab: int, seq: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (size, 1), generator=gen)
        stride = torch.randint(1, 8, (size, 1), generator=gen)
        self.tokens = (start + stride * torch.arange(seq + 1)) % vocab

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.tokens[index]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The example's flags and DeepSpeed's (``--deepspeed_config``); ``argv`` None: the command
    line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps to train")
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--save_dir", default=None, help="save a checkpoint here at the end")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[float]:
    """Train as the flags say; returns every micro-batch's loss (rank 0 also prints a summary)."""
    args = parse_args(argv)
    torch.manual_seed(0)  # the same initial weights on every rank (ds-zero broadcasts anyway)
    stage = json.loads(Path(args.deepspeed_config).read_text())["zero_optimization"]["stage"]
    # ZeRO stage 3 partitions each layer's weights as it is built: no rank holds the whole model.
    with deepspeed.zero.Init(config_dict_or_path=args.deepspeed_config, enabled=stage == 3):
        model = GPT(args.vocab, args.seq, args.dim, args.layers, args.heads)
    data = CountingLanguage(50_000, args.vocab, args.seq)
    engine, _, loader, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=data
    )
    losses: list[float] = []
    batches = iter(loader)
    while engine.global_steps < args.steps:
        tokens = next(batches)
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    if args.save_dir:
        engine.save_checkpoint(args.save_dir)
    if engine.global_rank == 0:
        window = max(len(losses) // 10, 1)
        first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
        print(
            f"rank 0 of {int(os.environ.get('WORLD_SIZE', 1))}: loss {first:.3f} -> {last:.3f} "
            f"(uniform guess: {math.log(args.vocab):.3f}) in {engine.global_steps} steps"
        )
    return losses


if __name__ == "__main__":
    main()
