"""MoE under ZeRO-3 with expert parallelism against the ``ep_size=1`` baseline: communication
bytes per step per collective kind, step time, model-state memory per rank and the loss, measured
in the same run.

Starts ``--world-size`` local gloo ranks once (file-store rendezvous); each rank trains a small
MoE transformer (token and position embeddings, ``--layers`` blocks of causal attention and a
``ds_moe.MoE`` feed-forward of ``--experts`` two-layer experts, k=1, a vocabulary head) through
``ds_engine.initialize`` at ``zero_optimization.stage: 3`` with Adam, once per mode, from the
same initial weights (every expert drawn apart, loaded through ``expert_parallel_state_dict``)
on the same batches (counting sequences: a learnable next-token task):

* ``ep=1``: the non-parallel baseline: every expert on every rank, each expert's parameters
  sharded over all ranks (gathered for the forward and the backward, gradients reduce-scattered);
* ``ep=N`` for each ``N`` in ``--ep`` (default: the world size): the experts split over groups
  of ``N`` ranks, tokens travel to their expert by all-to-all, and each expert is sharded over
  its expert-data-parallel group of ``world / N`` ranks (no collective for it at ``N = world``).

Routing is the same in every mode (gating is per rank on its own tokens, no random token
selection), so the losses should agree up to rounding; the table shows the largest relative
difference from ``ep=1`` over the steps.

The bytes are ds-comm's comms logger's (``comms_logger`` in the engine config, read through
``tools/bench/_shared/comm_bytes.py`` as ``tools/bench/zeropp.py`` does): per collective kind,
what each rank puts on the wire per step (``msg_bytes * (n - 1) / n``, twice that for an
all-reduce), averaged over the timed steps and the ranks, in MiB (the all-reduce, the gradient
norm's few bytes, in KiB); "(grp)" is the part that ran within a group smaller than the world
(expert-data-parallel groups). Every parameter travels through the stage 3 hooks (persistence
threshold 0, reuse distance 0: the backward gathers again). The step time is the median over the
timed steps of the slowest rank; the memory is ``engine.memory_usage()`` (parameters, gradients
and optimizer state this rank holds: its ZeRO-3 partitions), the busiest rank. At ZeRO-3 it is
the same in every mode: ``ep=1`` shards all experts over all ranks, ``ep=N`` holds ``1/N`` of
the experts sharded over ``world / N`` ranks, ``1/world`` of them either way; what expert
parallelism saves is the experts' gathers and gradient reductions, for a token all-to-all.

Usage (from the workspace root)::

    uv run python tools/bench/moe_zero3.py                    # 2 ranks: ep=1 vs ep=2
    uv run python tools/bench/moe_zero3.py --world-size 4 --ep 2 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _shared import comm_bytes, rounds  # tools/bench/_shared (this script's folder is on sys.path)
from torch import nn

MIB = 1 << 20
COLUMNS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")


class MoETransformer(nn.Module):
    """Embeddings, ``layers`` pre-norm blocks (causal attention, MoE feed-forward), a head."""

    def __init__(self, args: argparse.Namespace, ep_size: int) -> None:
        import ds_moe

        super().__init__()
        dim = args.dim
        self.embed = nn.Embedding(args.vocab, dim)
        self.pos = nn.Parameter(torch.zeros(args.seq, dim))
        self.norms1 = nn.ModuleList(nn.LayerNorm(dim) for _ in range(args.layers))
        self.norms2 = nn.ModuleList(nn.LayerNorm(dim) for _ in range(args.layers))
        self.attns = nn.ModuleList(
            nn.MultiheadAttention(dim, args.heads, batch_first=True, bias=False)
            for _ in range(args.layers)
        )
        expert = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.moes = nn.ModuleList(
            ds_moe.MoE(
                dim,
                expert,
                num_experts=args.experts,
                ep_size=ep_size,
                k=1,
                capacity_factor=args.capacity_factor,
                use_rts=False,
            )
            for _ in range(args.layers)
        )
        self.head = nn.Linear(dim, args.vocab)
        self.vocab, self.seq = args.vocab, args.seq

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = self.embed(inputs) + self.pos[: inputs.shape[1]]
        n = inputs.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool, device=tokens.device).triu(1)
        aux = x.new_zeros(())
        for norm1, attn, norm2, moe in zip(self.norms1, self.attns, self.norms2, self.moes):
            h = norm1(x)
            x = x + attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            mixed, l_aux, _ = moe(norm2(x))
            x, aux = x + mixed, aux + l_aux
        logits = self.head(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))
        return loss + 0.01 * aux


def _model(args: argparse.Namespace, ep_size: int) -> MoETransformer:
    """This rank's share of the ``ep_size=1`` model drawn from seed 0 (experts distinct)."""
    import ds_moe

    def drawn(ep: int) -> MoETransformer:
        model = MoETransformer(args, ep)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        return model

    model = MoETransformer(args, ep_size)
    groups = ds_moe.configure_expert_parallelism(model)
    model.load_state_dict(ds_moe.expert_parallel_state_dict(model, drawn(1).state_dict(), groups))
    return model


def _tokens(args: argparse.Namespace, step: int, rank: int) -> torch.Tensor:
    """Counting sequences with a random start and stride (the same in every mode)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    start = torch.randint(0, args.vocab, (args.batch, 1), generator=gen)
    stride = torch.randint(1, 4, (args.batch, 1), generator=gen)
    return (start + stride * torch.arange(args.seq + 1)) % args.vocab


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_clipping": 1.0,
        "steps_per_print": 1_000_000,
        "optimizer": {"type": "Adam", "params": {"lr": args.lr, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": args.persistence_threshold,
            "stage3_max_reuse_distance": 0,  # the backward gathers again, as in zeropp.py
            "reduce_bucket_size": 2_000_000,
            "stage3_prefetch_bucket_size": 2_000_000,
        },
        "comms_logger": {"enabled": True, "prof_all": True, "verbose": False},
    }


def _run_mode(ep_size: int, args: argparse.Namespace) -> dict[str, Any]:
    import ds_comm
    import ds_engine

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, *_ = ds_engine.initialize(model=_model(args, ep_size), config=_config(args))
    logger = ds_comm.get_comms_logger()
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            logger.reset()
        batch = _tokens(args, step, rank)
        dist.barrier()
        start = time.perf_counter()
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    wire = comm_bytes.wire_bytes(logger.summary(), world)
    flat = [wire[k][scope] / args.steps for k in COLUMNS for scope in ("world", "group")]
    memory = engine.memory_usage()
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    mean = torch.tensor(losses + flat, dtype=torch.float64)
    dist.all_reduce(mean)
    mean /= world
    states = torch.tensor(
        [memory.params, memory.grads, memory.optimizer_state, memory.model_states],
        dtype=torch.float64,
    )
    dist.all_reduce(states, op=dist.ReduceOp.MAX)
    engine.destroy()
    n = len(losses)
    columns = [f"{k}:{scope}" for k in COLUMNS for scope in ("world", "group")]
    return {
        "step_s": statistics.median(slowest.tolist()),
        "losses": mean[:n].tolist(),
        "bytes": dict(zip(columns, mean[n:].tolist())),
        "memory": dict(zip(("params", "grads", "optim", "total"), states.tolist())),
    }


def _bench_rank(rank: int, args: argparse.Namespace, tmp: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=args.world_size
    )
    ep_of = {f"ep={ep_size}": ep_size for ep_size in [1, *args.ep]}
    results = rounds.best_of_rounds(
        list(ep_of), lambda mode: _run_mode(ep_of[mode], args), args.rounds, verbose=rank == 0
    )
    if rank == 0:
        Path(tmp, "results.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def print_table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    """One row per mode, every ratio against ``ep=1`` from the same run."""
    base = results["ep=1"]
    print(
        f"\nMoE under ZeRO-3, expert parallelism vs ep=1: {args.layers} blocks, dim {args.dim}, "
        f"{args.experts} experts (ffn {4 * args.dim}, k=1, capacity factor "
        f"{args.capacity_factor}) per block, vocab {args.vocab}, batch {args.batch}x{args.seq} "
        f"per rank, {args.world_size} gloo ranks, {args.steps} timed steps"
    )
    head = (
        f"{'mode':>5} | {'all-gather MiB':>14} | {'(grp)':>6} | {'reduce-scatter MiB':>18} | "
        f"{'(grp)':>6} | {'all-to-all MiB':>14} | {'all-reduce KiB':>14} | {'total MiB':>9} | "
        f"{'step s':>7} | {'vs ep=1':>7} | {'states MiB':>10} | {'vs ep=1':>7} | "
        f"{'loss first->last':>16} | {'max dloss':>9}"
    )
    print(head + "\n" + "-" * len(head))
    for mode, r in results.items():
        b = r["bytes"]
        kind = {k: b[f"{k}:world"] + b[f"{k}:group"] for k in COLUMNS}
        total = sum(kind.values())
        drift = max(abs(a - z) / abs(z) for a, z in zip(r["losses"], base["losses"], strict=True))
        print(
            f"{mode:>5} | {kind['all_gather'] / MIB:14.2f} | {b['all_gather:group'] / MIB:6.2f} | "
            f"{kind['reduce_scatter'] / MIB:18.2f} | {b['reduce_scatter:group'] / MIB:6.2f} | "
            f"{kind['all_to_all'] / MIB:14.2f} | {kind['all_reduce'] / 1024:14.2f} | "
            f"{total / MIB:9.2f} | {r['step_s']:7.3f} | {r['step_s'] / base['step_s']:6.2f}x | "
            f"{r['memory']['total'] / MIB:10.2f} | "
            f"{r['memory']['total'] / base['memory']['total']:6.2f}x | "
            f"{r['losses'][0]:7.4f}->{r['losses'][-1]:7.4f} | {drift:9.1e}"
        )
    print(
        "(MiB per step each rank puts on the wire, by collective kind; (grp): the part within "
        "expert-data-parallel groups smaller than the world; all-gather: ZeRO-3's parameter "
        "gathers; reduce-scatter: its gradient reduction; all-to-all: the MoE token dispatch and "
        "combine, forward and backward; all-reduce (KiB): the gradient norm. step s: "
        "median of the slowest rank; states: parameters + gradients + optimizer state of the "
        "busiest rank (engine.memory_usage()); loss: the first and the last step's, mean over "
        "ranks; "
        "max dloss: the largest relative loss difference from ep=1 over all steps)"
    )
    for mode, r in results.items():
        m = r["memory"]
        print(
            f"{mode}: states per rank: params {m['params'] / MIB:.2f} MiB, grads "
            f"{m['grads'] / MIB:.2f} MiB, optimizer {m['optim'] / MIB:.2f} MiB"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8, help="experts per MoE layer")
    parser.add_argument("--capacity-factor", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--steps", type=int, default=8, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--persistence-threshold", type=int, default=0, help="ZeRO-3 persistence")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--ep", type=int, nargs="+", default=None, help="ep sizes besides 1")
    parser.add_argument("--rounds", type=int, default=1, help="the fastest round counts")
    args = parser.parse_args(argv)
    args.ep = [e for e in (args.ep or [args.world_size]) if e != 1]
    for ep in args.ep:
        if args.world_size % ep or args.experts % ep:
            parser.error(
                f"--ep {ep}: must divide --world-size {args.world_size} and --experts "
                f"{args.experts}"
            )
    with tempfile.TemporaryDirectory(prefix="ds-bench-moe-zero3-") as tmp:
        mp.spawn(_bench_rank, args=(args, tmp), nprocs=args.world_size)
        results = json.loads(Path(tmp, "results.json").read_text())
    print_table(results, args)


if __name__ == "__main__":
    main()
