"""ZeRO++ (qwZ, qgZ, hpZ) against plain fp32 ZeRO-3: communication bytes per step, step time and
the loss after the run, measured in the same run.

Starts ``--world-size`` local gloo ranks once (file-store rendezvous); each rank trains the GPT
of ``tools/examples/gpt`` (token and position embeddings, pre-norm blocks, a head tied to the
token embedding) in fp32 with ``torch.optim.AdamW`` through ``ds_zero.Stage3Optimizer``, once per
mode, from the same initial weights on the same batches:

* ``zero3``: plain ZeRO-3, the baseline;
* ``qwZ``: ``zero_quantized_weights`` (int8 blockwise weight all-gathers);
* ``qgZ``: ``zero_quantized_gradients`` (int8 all-to-all gradient reduction);
* ``qwZ+qgZ``: both;
* ``hpZ``: ``zero_hpz_partition_size = --hpz`` (default: half the ranks), the backward's
  re-gathers within groups of that many ranks;
* ``ZeRO++``: all three;
* ``MiCS``: ``mics_shard_size = --hpz``: stage 3 within shard groups of that many ranks, the
  reduced gradient shards all-reduced across the groups (the "all-reduce" column).

The bytes are ds-comm's comms logger's (``ds_comm.get_comms_logger().summary()``): per op, the
bytes each rank puts on the wire (``msg_bytes * (n - 1) / n``, nccl-tests' bus factor; see
``ds_comm/_logger.py``), averaged over the timed steps and the ranks. "gather" is the parameter
all-gathers (over all ranks; those within hpZ's or MiCS's groups in their own column),
"reduce" the gradient reduction (reduce-scatter, or all-to-all under qgZ), "all-reduce" the
rest (MiCS's replica reduction; the gradient norm's few bytes in every mode). Every parameter travels through the stage 3
hooks (persistence threshold 0), so the fp32 baseline moves the whole model each way. The step
time is the median over the timed steps of the slowest rank. Targets: qwZ cuts the gather bytes
and qgZ the reduce bytes at least 3x against ``zero3``.

Usage (from the workspace root)::

    uv run python tools/bench/zeropp.py                      # 2 ranks, ~3M params
    uv run python tools/bench/zeropp.py --world-size 4       # hpZ with groups of 2
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _shared import comm_bytes, rounds  # tools/bench/_shared (this script's folder is on sys.path)
from torch import nn

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt" / "train.py"
MIB = 1 << 20
TARGET = 3.0
MODES: dict[str, dict[str, Any]] = {
    "zero3": {},
    "qwZ": {"zero_quantized_weights": True},
    "qgZ": {"zero_quantized_gradients": True},
    "qwZ+qgZ": {"zero_quantized_weights": True, "zero_quantized_gradients": True},
    "hpZ": {"hpz": True},
    "ZeRO++": {"zero_quantized_weights": True, "zero_quantized_gradients": True, "hpz": True},
    "MiCS": {"mics": True},
}


def _gpt_class() -> type[nn.Module]:
    """The example's GPT (loaded by path: ``tools/examples`` is not a package)."""
    spec = importlib.util.spec_from_file_location("ds_example_gpt", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GPT


def _section(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    extra = dict(MODES[mode])
    if extra.pop("hpz", False):
        extra["zero_hpz_partition_size"] = args.hpz
    if extra.pop("mics", False):
        extra["mics_shard_size"] = args.hpz
    return {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_reuse_distance": 0,
        "reduce_bucket_size": 2_000_000,
        "stage3_prefetch_bucket_size": 2_000_000,
        **extra,
    }


def _bytes(summary: list[Any], world: int) -> dict[str, float]:
    """Wire bytes by column: gathers over all ranks, gathers within hpZ groups, reductions."""
    wire = comm_bytes.wire_bytes(summary, world)
    return {
        "gather": wire["all_gather"]["world"],
        "gather_hpz": wire["all_gather"]["group"],
        "reduce": sum(wire["reduce_scatter"].values()) + sum(wire["all_to_all"].values()),
        "all_reduce": sum(wire["all_reduce"].values()) + sum(wire["other"].values()),
    }


def _run_mode(mode: str, gpt: type[nn.Module], args: argparse.Namespace) -> dict[str, Any]:
    import ds_comm
    import ds_zero

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = gpt(args.vocab, args.seq, args.dim, args.layers, args.heads)
    config = ds_zero.ZeroConfig.from_dict(_section(mode, args))
    zero = ds_zero.Stage3Optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), config)
    gen = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, args.vocab, (world * args.batch, args.seq + 1), generator=gen)
        for _ in range(args.warmup + args.steps)
    ]
    logger = ds_comm.get_comms_logger()
    times, loss = [], 0.0
    for step, batch in enumerate(batches):
        if step == args.warmup:
            logger.reset()
        dist.barrier()
        start = time.perf_counter()
        loss_t = model(batch.chunk(world)[rank])
        zero.backward(loss_t)
        zero.step()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        loss = loss_t.item()
    wire = _bytes(logger.summary(), world)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    total = torch.tensor([loss, *wire.values()], dtype=torch.float64)
    dist.all_reduce(total)
    total /= world
    zero.destroy()
    del zero, model
    gc.collect()
    per_step = {k: v / args.steps for k, v in zip(wire, total[1:].tolist())}
    return {"step_s": statistics.median(slowest.tolist()), "loss": total[0].item(), **per_step}


def _bench_rank(rank: int, args: argparse.Namespace, tmp: str) -> None:
    import ds_comm

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=args.world_size
    )
    gpt = _gpt_class()
    ds_comm.configure(enabled=True, prof_all=True)
    results = rounds.best_of_rounds(
        args.modes, lambda mode: _run_mode(mode, gpt, args), args.rounds, verbose=rank == 0
    )
    if rank == 0:
        Path(tmp, "results.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def print_table(results: Mapping[str, Mapping[str, Any]], args: argparse.Namespace) -> None:
    base = results.get("zero3")
    print(
        f"\nZeRO++ vs fp32 ZeRO-3: GPT {args.layers} layers, dim {args.dim}, vocab {args.vocab}, "
        f"batch {args.batch}x{args.seq} per rank, {args.world_size} gloo ranks, hpZ groups of "
        f"{args.hpz} (MiCS: shard groups of {args.hpz}), {args.steps} timed steps"
    )
    head = (
        f"{'mode':>8} | {'gather MiB':>10} | {'vs zero3':>8} | {'in-group MiB':>12} | "
        f"{'reduce MiB':>10} | {'vs zero3':>8} | {'all-reduce MiB':>14} | {'step s':>7} | "
        f"{'vs zero3':>8} | {'loss':>7}"
    )
    print(head + "\n" + "-" * len(head))

    def ratio(value: float, reference: float) -> str:
        return f"{reference / value:7.2f}x" if value > 0 and reference > 0 else "-"

    for mode, r in results.items():
        g = ratio(r["gather"], base["gather"]) if base else "-"
        d = ratio(r["reduce"], base["reduce"]) if base else "-"
        t = f"{r['step_s'] / base['step_s']:7.2f}x" if base else "-"
        print(
            f"{mode:>8} | {r['gather'] / MIB:10.2f} | {g:>8} | {r['gather_hpz'] / MIB:12.2f} | "
            f"{r['reduce'] / MIB:10.2f} | {d:>8} | {r['all_reduce'] / MIB:14.2f} | "
            f"{r['step_s']:7.3f} | {t:>8} | {r['loss']:7.4f}"
        )
    print(
        "(MiB per step each rank puts on the wire; 'vs zero3' of the bytes is the reduction "
        "factor, of the step time the slowdown; gather: all-gathers over all ranks, in-group: "
        "within hpZ's or MiCS's groups; reduce: reduce-scatter or qgZ's all-to-all; all-reduce: "
        "MiCS's replica reduction and the gradient norm; loss: the last step's, mean over ranks)"
    )
    if base:
        for mode, column in (("qwZ", "gather"), ("qgZ", "reduce")):
            if mode in results and results[mode][column] > 0:
                cut = base[column] / results[mode][column]
                verdict = "PASS" if cut >= TARGET else "FAIL"
                print(f"{mode} cuts {column} bytes {cut:.2f}x, target >= {TARGET}x: {verdict}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--dim", type=int, default=192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hpz", type=int, default=0, help="hpZ group size (0: half the ranks)")
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--rounds", type=int, default=1, help="the fastest round counts")
    args = parser.parse_args(argv)
    if args.hpz == 0:
        args.hpz = max(1, args.world_size // 2)
    if args.hpz == 1:
        args.modes = [m for m in args.modes if not {"hpz", "mics"} & set(MODES[m])]
    with tempfile.TemporaryDirectory(prefix="ds-bench-zeropp-") as tmp:
        mp.spawn(_bench_rank, args=(args, tmp), nprocs=args.world_size)
        results = json.loads(Path(tmp, "results.json").read_text())
    print_table(results, args)


if __name__ == "__main__":
    main()
