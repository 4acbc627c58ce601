"""PR-MoE language model and Mixture-of-Students distillation, a few steps on CPU.

1. Trains a small pyramid-residual MoE (PR-MoE) language model: every block's feed-forward is an
   ``ds_moe.MoE`` with ``use_residual=True`` (a dense MLP next to the experts, mixed by a learned
   coefficient), and later blocks have more experts (the pyramid, ``--teacher-experts 4 4 8 8``).
2. Distils it into a shallower student (``--student-experts 4 8``) with
   ``ds_moe.MixtureOfStudents``: task loss + KD loss until ``--kd-stop-step``, then the task loss
   alone (staged KD).
3. Saves the student with one file per expert (``ds_moe.save_moe_checkpoint``).

The data is a synthetic language (a fixed random bigram chain with two likely successors per
token), so the loss has a known floor (printed) to fall towards.

Run alone, or with expert parallelism over several processes (experts split ``--ep-size`` ways)::

    uv run python tools/examples/moe/train_pr_moe.py
    uv run torchrun --nproc-per-node 2 tools/examples/moe/train_pr_moe.py --ep-size 2
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

import ds_comm
import ds_moe


class Block(nn.Module):
    """Pre-norm transformer block whose feed-forward is a residual MoE."""

    def __init__(self, hidden: int, num_experts: int, ep_size: int, k: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = nn.MultiheadAttention(hidden, num_heads=4, batch_first=True)
        self.norm2 = nn.LayerNorm(hidden)
        expert = nn.Sequential(
            nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)
        )
        self.moe = ds_moe.MoE(
            hidden, expert, num_experts=num_experts, ep_size=ep_size, k=k, use_residual=True
        )

    def forward(self, x: torch.Tensor, causal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        out, l_aux, _ = self.moe(self.norm2(x))
        return x + out, l_aux


class PRMoELM(nn.Module):
    """Token embedding, one block per entry of ``experts_per_block``, a linear output head."""

    def __init__(self, vocab: int, hidden: int, experts_per_block: list[int], ep_size: int, k: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Parameter(torch.randn(256, hidden) * 0.02)
        self.blocks = nn.ModuleList(Block(hidden, n, ep_size, k) for n in experts_per_block)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq = tokens.size(1)
        causal = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
        x = self.embed(tokens) + self.pos[:seq]
        l_aux = x.new_zeros(())
        for block in self.blocks:
            x, block_l_aux = block(x, causal)
            l_aux = l_aux + block_l_aux
        return self.head(self.norm(x)), l_aux


class BigramLanguage:
    """Sequences from a fixed chain: each token is followed by one of two successors (3:1)."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.successors = torch.stack([torch.randperm(vocab, generator=gen) for _ in range(2)], 1)
        self.vocab = vocab

    def entropy(self) -> float:
        """The loss floor in nats per token."""
        return -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))

    def batch(self, size: int, seq: int, gen: torch.Generator) -> torch.Tensor:
        tokens = torch.empty(size, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab, (size,), generator=gen)
        for t in range(seq):
            pick = (torch.rand(size, generator=gen) < 0.25).long()
            tokens[:, t + 1] = self.successors[tokens[:, t], pick]
        return tokens


def _optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    # Expert parameters get their own groups (ZeRO and the engine reduce them separately).
    groups = ds_moe.split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "dense", "lr": lr}
    )
    return torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)


def _step(model, optimizer, groups, loss: torch.Tensor) -> None:
    optimizer.zero_grad()
    loss.backward()
    ds_moe.all_reduce_gradients(model, groups)
    optimizer.step()


def _lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train_teacher(args, data: BigramLanguage, gen: torch.Generator, log) -> nn.Module:
    teacher = PRMoELM(args.vocab, args.hidden, args.teacher_experts, args.ep_size, args.k)
    groups = ds_moe.configure_expert_parallelism(teacher)
    optimizer = _optimizer(teacher, args.lr)
    for step in range(args.teacher_steps):
        tokens = data.batch(args.batch, args.seq, gen)
        logits, l_aux = teacher(tokens[:, :-1])
        lm = _lm_loss(logits, tokens[:, 1:])
        _step(teacher, optimizer, groups, lm + args.aux_weight * l_aux)
        if step % 10 == 0 or step == args.teacher_steps - 1:
            log(f"teacher step {step:3d}  lm loss {lm.item():.3f}  l_aux {l_aux.item():.3f}")
    return teacher


def distil_student(args, teacher, data: BigramLanguage, gen: torch.Generator, log) -> nn.Module:
    student = PRMoELM(args.vocab, args.hidden, args.student_experts, args.ep_size, args.k)
    groups = ds_moe.configure_expert_parallelism(student)
    optimizer = _optimizer(student, args.lr)
    config = ds_moe.MoSConfig(
        kd_alpha_ce=1.0, kd_beta_ce=1.0, kd_temp=1.0, kd_stop_step=args.kd_stop_step
    )
    mos = ds_moe.MixtureOfStudents(teacher, config)
    for step in range(args.student_steps):
        tokens = data.batch(args.batch, args.seq, gen)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        logits, l_aux = student(inputs)
        lm = _lm_loss(logits, targets)
        teacher_logits = mos.teacher_logits(inputs) if mos.distilling(step) else None
        loss = mos.loss(step, logits, lm, teacher_logits) + args.aux_weight * l_aux
        _step(student, optimizer, groups, loss)
        if step % 10 == 0 or step == args.student_steps - 1:
            phase = "kd" if mos.distilling(step) else "task only"
            log(
                f"student step {step:3d}  lm loss {lm.item():.3f}  total {loss.item():.3f}  ({phase})"
            )
    ds_moe.save_moe_checkpoint(student, args.save_dir, groups=groups)
    return student


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--k", type=int, default=1, choices=(1, 2))
    parser.add_argument("--ep-size", type=int, default=1)
    parser.add_argument("--teacher-experts", type=int, nargs="+", default=[4, 4, 8, 8])
    parser.add_argument("--student-experts", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--teacher-steps", type=int, default=60)
    parser.add_argument("--student-steps", type=int, default=40)
    parser.add_argument("--kd-stop-step", type=int, default=25)
    parser.add_argument("--aux-weight", type=float, default=0.01)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save-dir", default=os.path.join(tempfile.gettempdir(), "pr_moe_student"))
    args = parser.parse_args(argv)

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        ds_comm.init_distributed(dist_backend="gloo", verbose=False)
    rank = ds_comm.get_rank() if ds_comm.is_initialized() else 0
    torch.manual_seed(0)  # the same initial weights on every rank
    data = BigramLanguage(args.vocab)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches

    def log(message: str) -> None:
        if rank == 0:
            print(message, flush=True)

    log(
        f"loss floor (entropy of the language): {data.entropy():.3f}; uniform: {math.log(args.vocab):.3f}"
    )
    teacher = train_teacher(args, data, gen, log)
    distil_student(args, teacher, data, gen, log)
    log(f"student saved to {args.save_dir} (one file per expert)")
    if ds_comm.is_initialized():
        ds_comm.destroy_process_group()


if __name__ == "__main__":
    main()
