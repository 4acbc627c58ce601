"""AutoTP (``tensor_parallel.autotp_size``) against TP=1: step time and per-rank memory, same run.

Starts ``--world-size`` local gloo ranks (file-store rendezvous) once per mode, so each mode's
peak RSS is its own, and trains the same Llama-style model (``--layers`` pre-norm blocks of
``q/k/v/o_proj`` attention and a ``gate/up/down_proj`` MLP, width ``--dim``, an untied
``lm_head``) through ``ds_engine.initialize`` at ZeRO ``--stage`` on the same global batches:

* ``tp1``: data parallel only (dp = world), micro-batch ``global / world``;
* ``tp2`` (and ``tp4``... up to the world size): ``"tensor_parallel": {"autotp_size": N}``,
  dp = world / N; the engine shards every projection (the embedding, norms and ``lm_head`` stay
  replicated) and the N tensor-parallel ranks of one replica read the same micro-batch.

Per mode the table shows the bytes one rank puts on the wire per step by collective kind, the
median step time of the slowest rank, the model-state bytes one rank holds (parameters,
gradients, optimizer state: ``engine.memory_usage()``), the parameters one rank holds, the peak
RSS of the busiest rank and the last step's loss (the same global batch in every mode, so the
losses agree). On CPU gloo the all-reduces of the activations make tensor parallelism slower
than data parallelism at this size; what it buys is memory per rank.

The bytes are ds-comm's comms logger's (``comms_logger`` in the engine config, read through
``tools/bench/_shared/comm_bytes.py`` as ``tools/bench/moe_zero3.py`` does): what each rank puts
on the wire per timed step (``msg_bytes * (n - 1) / n``, twice that for an all-reduce), mean
over the ranks. The all-reduce column holds the tensor-parallel all-reduces of the activations
(forward: one per row-parallel ``o_proj`` / ``down_proj``; backward: one per column-parallel
``q/k/v/gate/up_proj`` input gradient: 7 per block of ``micro x seq x dim`` fp32 values) and the
gradient norm's few bytes; the footer prints the hand count of the tensor-parallel part next to
it. When dp > 1 the data-parallel traffic lands where the ZeRO stage puts it (stages 1 and 2:
the gradients reduce-scattered, the updated parameters all-gathered; stage 0: all-reduced).

Usage (from the workspace root)::

    uv run python tools/bench/autotp.py                  # 2 ranks, dim 256, 4 layers
    uv run python tools/bench/autotp.py --world-size 4 --modes 1 2 4
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from _shared import comm_bytes  # tools/bench/_shared (this script's folder is on sys.path)
from torch import nn

MIB = 1 << 20
KINDS = ("all_reduce", "all_gather", "reduce_scatter")


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.q_proj, self.k_proj = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.v_proj, self.o_proj = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.self_attn = Attention(dim, heads)
        self.gate_proj = nn.Linear(dim, 4 * dim, bias=False)
        self.up_proj = nn.Linear(dim, 4 * dim, bias=False)
        self.down_proj = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.attn_norm(x))
        h = self.mlp_norm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        for layer in self.layers:
            x = layer(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _rank(rank: int, args: argparse.Namespace, tp: int, store: str, out: str) -> None:
    import ds_comm
    import ds_engine

    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=args.world_size
    )
    dp = args.world_size // tp
    micro = args.global_batch // dp
    torch.manual_seed(0)
    model = Llama(args.vocab, args.dim, args.layers, args.heads)
    config = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": args.stage},
        "tensor_parallel": {"autotp_size": tp},
        "comms_logger": {"enabled": True, "prof_all": True, "verbose": False},
    }
    engine, *_ = ds_engine.initialize(model=model, config=config)
    gen = torch.Generator().manual_seed(1)
    shape = (args.global_batch, args.seq + 1)
    batches = [torch.randint(0, args.vocab, shape, generator=gen) for _ in range(args.steps)]
    logger = ds_comm.get_comms_logger()
    times, loss = [], torch.zeros((), dtype=torch.float32)
    for i, batch in enumerate(batches):
        if i == args.warmup:
            logger.reset()  # the timed steps' bytes only
        mine = batch[engine.dp_rank * micro : (engine.dp_rank + 1) * micro]
        dist.barrier()
        start = time.perf_counter()
        step_loss = engine(mine)
        engine.backward(step_loss)
        engine.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        loss = step_loss.detach().clone()
    wire = comm_bytes.per_kind(logger.summary(), args.world_size)
    timed = args.steps - args.warmup
    sent = torch.tensor([wire[kind] / timed for kind in KINDS], dtype=torch.float64)
    dist.all_reduce(sent)  # torch's own collectives here: the logger has stopped counting
    sent /= args.world_size
    dist.all_reduce(loss, group=engine.dp_group)
    states = engine.memory_usage().model_states
    params = sum(p.numel() for p in engine.module.parameters())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    row = torch.tensor([statistics.median(times), states, params, rss], dtype=torch.float64)
    dist.all_reduce(row, op=dist.ReduceOp.MAX)  # the slowest / busiest rank
    if rank == 0:
        seconds, states, params, rss = row.tolist()
        result = {"ms": 1e3 * seconds, "states": states, "params": params, "rss": rss}
        result["bytes"] = dict(zip(KINDS, sent.tolist()))
        Path(out).write_text(json.dumps({**result, "loss": loss.item() / dp}))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--modes", type=int, nargs="+", default=[1, 2], help="tp sizes")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--stage", type=int, default=1, help="ZeRO stage (0, 1 or 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    results = {}
    for tp in args.modes:
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "result")
            store = str(Path(tmp) / "store")
            mp.spawn(_rank, args=(args, tp, store, out), nprocs=args.world_size)
            results[tp] = json.loads(Path(out).read_text())
    print_table(results, args)


def tp_all_reduce_bytes(args: argparse.Namespace, tp: int) -> float:
    """The hand count of one rank's tensor-parallel all-reduce wire bytes per step: 7 all-reduces
    per block (2 forward, 5 backward) of ``micro x seq x dim`` fp32 values, ``2 (n - 1) / n``
    of the message each."""
    if tp == 1:
        return 0.0
    micro = args.global_batch // (args.world_size // tp)
    message = micro * args.seq * args.dim * 4
    return 7 * args.layers * message * 2 * (tp - 1) / tp


def print_table(results: dict[int, dict], args: argparse.Namespace) -> None:
    """One row per mode, every ratio against the first mode (TP=1) of the same run."""
    base = results[args.modes[0]]
    print(
        f"\nAutoTP vs TP={args.modes[0]}: {args.world_size} gloo ranks, ZeRO-{args.stage}, "
        f"dim {args.dim}, {args.layers} layers, vocab {args.vocab}, global batch "
        f"{args.global_batch} x {args.seq} tokens, median of {args.steps - args.warmup} steps\n"
    )
    print(
        f"{'mode':<10} {'all-reduce MiB':>14} {'all-gather MiB':>14} {'red.-scat. MiB':>14} "
        f"{'ms/step':>9} {'vs base':>8} {'params/rank':>12} {'states MiB':>11} {'vs base':>8} "
        f"{'peak RSS MiB':>13} {'last loss':>10}"
    )
    for tp, r in results.items():
        mode, sent = f"tp{tp} x dp{args.world_size // tp}", r["bytes"]
        print(
            f"{mode:<10} {sent['all_reduce'] / MIB:>14.2f} {sent['all_gather'] / MIB:>14.2f} "
            f"{sent['reduce_scatter'] / MIB:>14.2f} {r['ms']:>9.1f} {r['ms'] / base['ms']:>8.2f} "
            f"{r['params'] / 1e6:>11.2f}M {r['states'] / MIB:>11.1f} "
            f"{r['states'] / base['states']:>8.2f} {r['rss'] / MIB:>13.1f} {r['loss']:>10.5f}"
        )
    print(
        "(MiB each rank puts on the wire per step, by collective kind, from ds-comm's comms "
        "logger, mean over ranks; all-reduce: the tensor-parallel activations', the gradient "
        "norm's and, at ZeRO-0 with dp > 1, the data-parallel gradients'; reduce-scatter / "
        "all-gather: ZeRO-1/2's data-parallel gradient reduction and parameter gather, dp > 1)"
    )
    for tp in args.modes:
        if tp > 1:
            expected = tp_all_reduce_bytes(args, tp) / MIB
            print(
                f"tp{tp}: hand count of the tensor-parallel all-reduces: 7 per block x "
                f"{args.layers} blocks x {args.global_batch // (args.world_size // tp)} x "
                f"{args.seq} x {args.dim} fp32 x 2({tp}-1)/{tp} = {expected:.4f} MiB/step "
                f"(measured all-reduce: {results[tp]['bytes']['all_reduce'] / MIB:.4f} MiB)"
            )


if __name__ == "__main__":
    main()
