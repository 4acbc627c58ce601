"""ds-engine overhead: the engine at ZeRO stage 0 next to a hand-written DDP loop, same run.

Starts ``--world-size`` local gloo ranks (file-store rendezvous). Each rank builds the same
GPT (``tools/examples/gpt/train.py``, about ``--params`` million parameters, tied embeddings)
twice from the same seed and trains both on the same random token batches:

* ``ddp``: the loop people write by hand: ``torch.nn.parallel.DistributedDataParallel``
  (PyTorch's defaults, ``bucket_cap_mb = --bucket-mb``), ``loss.backward()``,
  ``clip_grad_norm_(1.0)``, ``AdamW.step()``, ``zero_grad()``.
* ``engine``: ``ds_engine.initialize(model=..., optimizer=AdamW(...), config=...)`` at stage 0
  with ``gradient_clipping`` 1.0, ``overlap_comm`` (DDP overlaps too) and ``reduce_bucket_size`` the same ``--bucket-mb`` (in fp32
  elements; DeepSpeed's default of 5e8 elements would put the whole model in one bucket, reduced
  after backward instead of overlapped with it), and DeepSpeed's loop ``engine(batch)``,
  ``engine.backward(loss)``, ``engine.step()``. The client optimizer is the same
  ``torch.optim.AdamW``, so the difference is the engine (ds-zero's flat buffers and bucketed
  all-reduce, its counters and logging), not the optimizer kernel.

Rounds alternate the two loops (``--rounds`` rounds of ``--steps`` timed steps after
``--warmup``), so a load spike on a shared machine hits both; each mode's figure is the best
round's median step time of the slowest rank. Target: engine <= 1.05x ddp (overhead <= 5%).

Usage (from the workspace root)::

    uv run python tools/bench/engine.py                       # ~100M params, 2 ranks
    uv run python tools/bench/engine.py --params 10 --steps 5 # a quick look
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))
from train import GPT  # the example's model

TARGET = 1.05
HEAD_DIM = 64


def model_dims(params_m: float, layers: int, vocab: int) -> int:
    """The width (a multiple of HEAD_DIM) whose GPT has about ``params_m`` million parameters:
    ``12 * layers * dim**2`` in the blocks plus ``vocab * dim`` in the tied embedding."""
    a, b, c = 12 * layers, vocab, -params_m * 1e6
    dim = (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)
    return max(HEAD_DIM, round(dim / HEAD_DIM) * HEAD_DIM)


def _build(args: argparse.Namespace, dim: int) -> GPT:
    torch.manual_seed(0)
    return GPT(args.vocab, args.seq, dim, args.layers, dim // HEAD_DIM)


def _ddp_loop(args: argparse.Namespace, dim: int):
    ddp = torch.nn.parallel.DistributedDataParallel(_build(args, dim), bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)

    def step(batch: torch.Tensor) -> None:
        loss = ddp(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)

    return step


def _engine_loop(args: argparse.Namespace, dim: int):
    import ds_engine

    model = _build(args, dim)
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        # overlap_comm: reduce each bucket asynchronously while backward goes on, as DDP does.
        "zero_optimization": {
            "stage": 0,
            "reduce_bucket_size": int(args.bucket_mb * 2**20 / 4),
            "overlap_comm": True,
        },
    }
    engine, *_ = ds_engine.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4), config=config
    )

    def step(batch: torch.Tensor) -> None:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()

    return step


def _time(step: Any, batches: list[torch.Tensor]) -> float:
    times = []
    for batch in batches:
        dist.barrier()
        start = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rank(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=args.world_size
    )
    dim = model_dims(args.params, args.layers, args.vocab)
    loops = {"ddp": _ddp_loop(args, dim), "engine": _engine_loop(args, dim)}
    gen = torch.Generator().manual_seed(1 + rank)
    shape = (args.micro_batch, args.seq + 1)
    batches = [torch.randint(0, args.vocab, shape, generator=gen) for _ in range(args.steps)]
    for step in loops.values():
        for batch in batches[: args.warmup]:
            step(batch)
    best = {name: math.inf for name in loops}
    for _ in range(args.rounds):
        for name, step in loops.items():
            median = torch.tensor([_time(step, batches)])
            dist.all_reduce(median, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            best[name] = min(best[name], median.item())
    if rank == 0:
        params = sum(p.numel() for p in _build(args, dim).parameters())
        Path(out).write_text(json.dumps({"params": params, "dim": dim, "best": best}))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100, help="model size, millions")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=25, help="gradient bucket, MiB")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result")
        mp.spawn(_rank, args=(args, str(Path(tmp) / "store"), out), nprocs=args.world_size)
        result = json.loads(Path(out).read_text())  # written by rank 0
    params, dim, best = result["params"], result["dim"], result["best"]
    ratio = best["engine"] / best["ddp"]
    print(
        f"\nds-engine stage 0 vs hand-written DDP: {params / 1e6:.1f}M params (dim {dim}, "
        f"{args.layers} layers), {args.world_size} gloo ranks, micro-batch {args.micro_batch} x "
        f"{args.seq} tokens, best of {args.rounds} rounds x {args.steps} steps\n"
    )
    print(f"{'loop':<8} {'ms/step':>10} {'vs ddp':>8}")
    print(f"{'ddp':<8} {1e3 * best['ddp']:>10.1f} {1.0:>8.3f}")
    print(f"{'engine':<8} {1e3 * best['engine']:>10.1f} {ratio:>8.3f}")
    verdict = "met" if ratio <= TARGET else "NOT met"
    print(f"\ntarget: engine overhead <= {100 * (TARGET - 1):.0f}% ({ratio:.3f}x): {verdict}")


if __name__ == "__main__":
    main()
