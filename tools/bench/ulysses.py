"""Ulysses sequence parallelism (``sequence_parallel_size``) against SP=1: peak activation memory
per rank at a long sequence, same run.

Each mode trains the same causal LM (``--layers`` pre-norm blocks of multi-head attention and a
GELU MLP, width ``--dim``) from the same seed on the same ``--seq``-token sequences through
``ds_engine.initialize`` at ZeRO ``--stage``, on ``sp`` local gloo ranks (file-store
rendezvous, one process group per mode):

* ``sp1``: one rank holds the whole sequence (torch SDPA over every token);
* ``sp2`` (``sp4``, ...): ``"sequence_parallel_size": N`` on N ranks; each rank gets its
  ``seq / N`` tokens (``deepspeed.sequence.shard_sequence``), attention runs through
  ``DistributedAttention`` (all-to-all to whole-sequence, ``heads / N`` heads), and the loss is
  ``sequence_parallel_loss`` (token-weighted over the group).

Per mode the table shows the tokens one rank holds, the bytes one rank puts on the wire per
step by collective kind, the peak activation memory of the busiest rank during forward and
backward (bytes allocated above what was live when the step began:
``torch.cuda.max_memory_allocated`` on a GPU; on the CPU, which has no allocator statistics, a
``TorchDispatchMode`` sums the live storages operators create, as
``tools/bench/activation_checkpointing.py`` does), the median step time of the slowest rank
and the last loss (the same sequences in every mode: the losses agree).

The bytes are ds-comm's comms logger's (``comms_logger`` in the engine config, read through
``tools/bench/_shared/comm_bytes.py`` as ``tools/bench/moe_zero3.py`` does): what each rank puts
on the wire per timed step (``msg_bytes * (n - 1) / n``, twice that for an all-reduce), mean
over the ranks. The all-to-all column is ``DistributedAttention``'s: per block 4 forward (q, k,
v to heads, the output back to sequence) and 4 backward, each of ``seq / sp x dim`` fp32 values
per rank; the footer prints that hand count next to it. The all-reduce column is the data-parallel
gradient reduction over the sequence-parallel ranks (each saw other tokens) at ZeRO-0, and the
loss's token counts and gradient norm's few bytes; at ZeRO-1 and 2 the gradients are
reduce-scattered and the parameters all-gathered instead.

Usage (from the workspace root)::

    uv run python tools/bench/ulysses.py                     # seq 8192, sp 1 and 2
    uv run python tools/bench/ulysses.py --modes 1 2 4 --seq 16384
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from _shared import comm_bytes  # tools/bench/_shared (this script's folder is on sys.path)
from _shared.live_bytes import LiveBytes
from torch import nn

MIB = 1 << 20
KINDS = ("all_to_all", "all_reduce", "all_gather", "reduce_scatter")


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``[b, s, h, d]`` causal attention."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.attention: Any = _sdpa

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(self.norm1(x)).chunk(3, -1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads) for t in qkv)
        x = x + self.proj(self.attention(q, k, v).reshape(b, s, d))
        return x + self.mlp(self.norm2(x))


class LM(nn.Module):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.dim)
        self.pos = nn.Embedding(args.seq, args.dim)
        self.blocks = nn.ModuleList(Block(args.dim, args.heads) for _ in range(args.layers))
        self.norm, self.head = nn.LayerNorm(args.dim), nn.Linear(args.dim, args.vocab)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos(position_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _peak_of(run: Any, device: torch.device) -> int:
    """Bytes allocated above the step's start while ``run()`` runs (forward and backward)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        run()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with LiveBytes() as tracker:
        run()
    return tracker.peak


def _rank(rank: int, args: argparse.Namespace, sp: int, store: str, out: str) -> None:
    import ds_comm
    import ds_engine
    from ds_engine.sequence import (
        DistributedAttention,
        sequence_parallel_loss,
        shard_sequence,
    )

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=sp)
    torch.manual_seed(0)
    model = LM(args)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "sequence_parallel_size": sp,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": args.stage},
        "comms_logger": {"enabled": True, "prof_all": True, "verbose": False},
    }
    engine, *_ = ds_engine.initialize(model=model, config=config)
    if sp > 1:
        for block in model.blocks:
            block.attention = DistributedAttention(_sdpa, engine.seq_parallel_group, gather_idx=1)
    gen = torch.Generator().manual_seed(1)
    logger = ds_comm.get_comms_logger()
    peaks, times, loss = [], [], torch.zeros(())
    for step in range(args.steps):
        if step == args.warmup:
            logger.reset()  # the timed steps' bytes only
        ids = torch.randint(0, args.vocab, (1, args.seq), generator=gen)
        sample = {"input_ids": ids, "position_ids": torch.arange(args.seq)[None], "labels": ids}
        batch = shard_sequence(sample, rank, sp)
        batch = {k: v.to(engine.device) for k, v in batch.items()}

        def fwd_bwd(batch: dict[str, torch.Tensor] = batch) -> None:
            nonlocal loss
            logits = engine(batch["input_ids"], batch["position_ids"])
            labels = batch["shift_labels"]
            local = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            value = sequence_parallel_loss(local, (labels != -100).sum(), engine.seq_parallel_group)
            engine.backward(value)
            loss = value.detach()

        dist.barrier()
        start = time.perf_counter()
        peak = _peak_of(fwd_bwd, engine.device)
        engine.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            peaks.append(peak)
    wire = comm_bytes.per_kind(logger.summary(), sp)
    timed = args.steps - args.warmup
    sent = torch.tensor([wire[kind] / timed for kind in KINDS], dtype=torch.float64)
    dist.all_reduce(sent)  # torch's own collectives here: the logger has stopped counting
    sent /= sp
    row = torch.tensor([max(peaks), statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(row, op=dist.ReduceOp.MAX)  # the busiest / slowest rank
    if rank == 0:
        peak, seconds = row.tolist()
        result = {"peak": peak, "ms": 1e3 * seconds, "loss": loss.item()}
        result["bytes"] = dict(zip(KINDS, sent.tolist()))
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--modes", type=int, nargs="+", default=[1, 2], help="sp sizes")
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--stage", type=int, default=1, help="ZeRO stage (0-3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    results = {}
    for sp in args.modes:
        with tempfile.TemporaryDirectory() as tmp:
            out, store = str(Path(tmp) / "result"), str(Path(tmp) / "store")
            mp.spawn(_rank, args=(args, sp, store, out), nprocs=sp)
            results[sp] = json.loads(Path(out).read_text())
    print_table(results, args)


def all_to_all_bytes(args: argparse.Namespace, sp: int) -> float:
    """The hand count of one rank's ``DistributedAttention`` wire bytes per step: 8 all-to-alls
    per block (4 forward, 4 backward) of ``seq / sp x dim`` fp32 values, ``(sp - 1) / sp`` of
    the message each."""
    return 8 * args.layers * (args.seq // sp) * args.dim * 4 * (sp - 1) / sp


def print_table(results: dict[int, dict], args: argparse.Namespace) -> None:
    """One row per mode, every ratio against the first mode (SP=1) of the same run."""
    base = results[args.modes[0]]
    print(
        f"\nUlysses vs SP={args.modes[0]}: gloo ranks = sp, ZeRO-{args.stage}, seq {args.seq}, "
        f"dim {args.dim}, {args.heads} heads, {args.layers} layers, vocab {args.vocab}, "
        f"median of {args.steps - args.warmup} steps\n"
    )
    print(
        f"{'mode':<6} {'tokens/rank':>11} {'all-to-all MiB':>14} {'all-reduce MiB':>14} "
        f"{'all-gather MiB':>14} {'red.-scat. MiB':>14} {'peak act. MiB/rank':>19} "
        f"{'vs base':>8} {'ms/step':>9} {'vs base':>8} {'last loss':>10}"
    )
    for sp, r in results.items():
        sent = r["bytes"]
        print(
            f"{'sp' + str(sp):<6} {args.seq // sp:>11} {sent['all_to_all'] / MIB:>14.2f} "
            f"{sent['all_reduce'] / MIB:>14.2f} {sent['all_gather'] / MIB:>14.2f} "
            f"{sent['reduce_scatter'] / MIB:>14.2f} {r['peak'] / MIB:>19.1f} "
            f"{r['peak'] / base['peak']:>8.2f} {r['ms']:>9.1f} {r['ms'] / base['ms']:>8.2f} "
            f"{r['loss']:>10.5f}"
        )
    print(
        "(MiB each rank puts on the wire per step, by collective kind, from ds-comm's comms "
        "logger, mean over ranks; all-to-all: DistributedAttention's; the rest: the gradient "
        "reduction over the sequence-parallel ranks, ZeRO's parameter gather, the loss's token "
        "counts and the gradient norm)"
    )
    for sp in args.modes:
        if sp > 1:
            expected = all_to_all_bytes(args, sp) / MIB
            print(
                f"sp{sp}: hand count of DistributedAttention's all-to-alls: 8 per block x "
                f"{args.layers} blocks x {args.seq // sp} x {args.dim} fp32 x ({sp}-1)/{sp} = "
                f"{expected:.4f} MiB/step (measured all-to-all: "
                f"{results[sp]['bytes']['all_to_all'] / MIB:.4f} MiB)"
            )


if __name__ == "__main__":
    main()
