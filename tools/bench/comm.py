"""Collective bandwidth: ds-comm against raw torch.distributed, measured in the same run.

Starts ``--world-size`` local ranks itself (file-store rendezvous, no ports) and, for each op and
message size, times the raw ``torch.distributed`` call and the ``ds_comm`` one alternately
(barrier before each, median over iterations of the slowest rank), then prints one table per op
and two checks:

* overhead: where ds-comm runs the same algorithm as torch (the ``native`` column), its time
  should be within 5% of torch's from 1 MiB up;
* speedup: on gloo, ds-comm's all-gather and reduce-scatter should be >= 1.5x torch's from 1 MiB.

Each rank gets ``cores // world_size`` intra-op threads (oversubscription makes every local
reduction erratic). Timing one call right after a barrier is the harsh case for per-call Python
overhead: a rank that wakes from the barrier runs cold, and every microsecond before the transfer
is issued delays the peer as well. The ``ds algo`` column is what ds-comm chose (see
``force_algorithm`` / ``DS_COMM_FORCE_ALGO`` in ``ds_comm/_collectives.py`` to pin one; ``shm``
is the shared-memory all-gather / reduce-scatter between ranks of one host, which these local
ranks are).

Sizes follow nccl-tests: the full buffer for all_reduce/broadcast, the output of all_gather, the
input of reduce_scatter and all_to_all. Bus bandwidth = algbw x (2(n-1)/n for all_reduce, (n-1)/n
for all_gather/reduce_scatter/all_to_all, 1 for broadcast).

Usage (from the workspace root)::

    uv run python tools/bench/comm.py                              # 2 ranks, gloo, 1 KiB..256 MiB
    uv run python tools/bench/comm.py --world-size 4 --ops all_gather_into_tensor --max-bytes 64M
    uv run python tools/bench/comm.py --ops all_gather reduce_scatter   # the list forms
    DS_COMM_FORCE_ALGO=reduce_scatter_tensor=ring uv run python tools/bench/comm.py \
        --ops reduce_scatter_tensor
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

OPS = (
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "broadcast",
)
# Not run by default: the list forms (one tensor per rank).
EXTRA_OPS = ("all_gather", "reduce_scatter")
# Ops ds-comm is meant to speed up on gloo (target >= 1.5x) vs ops it should only not slow down.
SPEEDUP_OPS = ("all_gather_into_tensor", "reduce_scatter_tensor", *EXTRA_OPS)
MIB = 1 << 20


@dataclass(frozen=True)
class Row:
    """One op and size: median seconds for torch and ds-comm, and the algorithm ds-comm used."""

    op: str
    nbytes: int
    torch_s: float
    ds_s: float
    algo: str


def parse_size(text: str) -> int:
    """``"1K"`` -> 1024, ``"256M"`` -> 268435456, ``"4096"`` -> 4096."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def human(nbytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"


def bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op == "broadcast":
        return 1.0
    return (n - 1) / n


def iterations(nbytes: int, iters: int) -> int:
    """Fewer iterations for big messages (keeps the default run to a few minutes)."""
    return max(8, min(iters, iters * 4 * MIB // max(nbytes, 1)))


def _buffers(
    op: str, nbytes: int, n: int, dtype: torch.dtype, device: torch.device
) -> tuple[Any, Any]:
    numel = nbytes // torch.tensor([], dtype=dtype).element_size()
    full = torch.rand(numel, device=device).to(dtype)
    if op == "all_gather_into_tensor":
        return torch.empty_like(full), full[: numel // n].clone()
    if op == "reduce_scatter_tensor":
        return torch.empty(numel // n, dtype=dtype, device=device), full
    if op == "all_to_all_single":
        return torch.empty_like(full), full
    if op == "all_gather":
        return list(torch.empty_like(full).chunk(n)), full[: numel // n].clone()
    if op == "reduce_scatter":
        return torch.empty(numel // n, dtype=dtype, device=device), list(full.chunk(n))
    return full, None


def _callables(op: str, a: Any, b: Any) -> tuple[Callable[[], Any], Callable[[], Any]]:
    import ds_comm

    if op in ("all_reduce", "broadcast"):
        args: tuple[Any, ...] = (a,) if op == "all_reduce" else (a, 0)
    else:
        args = (a, b)
    return (lambda: getattr(dist, op)(*args)), (lambda: getattr(ds_comm, op)(*args))


def _measure(fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    dist.barrier()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def _bench_rank(rank: int, args: argparse.Namespace, init_file: str) -> None:
    # Ranks share the host's cores: oversubscribed intra-op threads make every reduction erratic.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    device = torch.device("cpu")
    if args.backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group(
        args.backend, init_method=f"file://{init_file}", rank=rank, world_size=args.world_size
    )
    from ds_comm import _instrument

    algos: dict[str, str] = {}
    _instrument.TRACKER.on_end.append(lambda rec: algos.__setitem__(rec.fingerprint.op, rec.algo))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    n = args.world_size
    dtype = getattr(torch, args.dtype)
    rows: list[Row] = []
    for op in args.ops:
        size = args.min_bytes
        while size <= args.max_bytes:
            a, b = _buffers(op, size, n, dtype, device)
            torch_fn, ds_fn = _callables(op, a, b)
            for _ in range(args.warmup):
                torch_fn(), ds_fn()
            times: dict[str, list[float]] = {"torch": [], "ds": []}
            for it in range(iterations(size, args.iters)):
                order = (("torch", torch_fn), ("ds", ds_fn))
                for name, fn in order if it % 2 == 0 else order[::-1]:  # alternate who goes first
                    times[name].append(_measure(fn, sync))
            # the slowest rank defines each iteration's time
            stacked = torch.tensor([times["torch"], times["ds"]], dtype=torch.float64)
            dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
            rows.append(
                Row(
                    op,
                    size,
                    statistics.median(stacked[0].tolist()),
                    statistics.median(stacked[1].tolist()),
                    algos.get(op, "?"),
                )
            )
            del a, b
            size *= args.step
        if rank == 0:
            print_table([r for r in rows if r.op == op], n, args.backend)
            sys.stdout.flush()
    if rank == 0:
        print_checks(rows, n, args.backend)
    dist.destroy_process_group()


def print_table(rows: list[Row], n: int, backend: str) -> None:
    op = rows[0].op
    factor = bus_factor(op, n)
    print(f"\n{op}  ({n} ranks, {backend}; busbw = algbw x {factor:g})")
    header = f"{'size':>10} | {'torch ms':>9} | {'torch busbw':>11} | {'ds ms':>9} | {'ds busbw':>9} | {'speedup':>7} | ds algo"
    print(header)
    print("-" * len(header))
    for r in rows:
        tb = r.nbytes / r.torch_s * factor / 1e9
        db = r.nbytes / r.ds_s * factor / 1e9
        print(
            f"{human(r.nbytes):>10} | {r.torch_s * 1e3:9.3f} | {tb:8.2f} GB/s | {r.ds_s * 1e3:9.3f} | "
            f"{db:6.2f} GB/s | {r.torch_s / r.ds_s:6.2f}x | {r.algo}"
        )


def print_checks(rows: list[Row], n: int, backend: str) -> None:
    big = [r for r in rows if r.nbytes >= MIB]
    print("\nChecks (messages >= 1 MiB):")
    same = [r for r in big if r.algo == "native"]
    if same:
        ratios = [r.ds_s / r.torch_s for r in same]
        geo = statistics.geometric_mean(ratios) - 1
        worst = max(same, key=lambda r: r.ds_s / r.torch_s)
        verdict = "PASS" if geo < 0.05 else "FAIL"
        print(
            f"  overhead, ds-comm vs torch where both run the native op: {geo:+.1%} (geometric mean"
            f" of {len(same)} op/size pairs; worst {worst.ds_s / worst.torch_s - 1:+.1%} at"
            f" {worst.op} {human(worst.nbytes)}); target < 5%: {verdict}"
        )
    fast = [r for r in big if r.op in SPEEDUP_OPS]
    if fast and backend == "gloo" and n > 1:
        for op in SPEEDUP_OPS:
            mine = [r for r in fast if r.op == op]
            if not mine:
                continue
            low = min(mine, key=lambda r: r.torch_s / r.ds_s)
            speedups = ", ".join(f"{human(r.nbytes)} {r.torch_s / r.ds_s:.2f}x" for r in mine)
            verdict = "PASS" if low.torch_s / low.ds_s >= 1.5 else "FAIL"
            print(
                f"  speedup {op}: {speedups}; min {low.torch_s / low.ds_s:.2f}x, target >= 1.5x: {verdict}"
            )
    print(
        "  (shared or loaded machines make single sizes noisy: rerun, or raise --iters, before"
        " trusting one number)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--ops", nargs="+", default=list(OPS), choices=OPS + EXTRA_OPS, metavar="OP",
        help=f"default: {' '.join(OPS)}; also: {' '.join(EXTRA_OPS)}",
    )  # fmt: skip
    parser.add_argument("--min-bytes", type=parse_size, default=parse_size("1K"))
    parser.add_argument("--max-bytes", type=parse_size, default=parse_size("256M"))
    parser.add_argument("--step", type=int, default=4, help="size multiplier between rows")
    parser.add_argument(
        "--iters", type=int, default=100, help="timed iterations up to 4 MiB (fewer above)"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args(argv)
    if args.min_bytes % (4 * args.world_size):
        parser.error("--min-bytes must be a multiple of 4 x world size")
    with tempfile.TemporaryDirectory(prefix="ds-bench-comm-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.spawn(_bench_rank, args=(args, init_file), nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
