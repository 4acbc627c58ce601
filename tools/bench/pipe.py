"""ds-pipe's pipeline engine next to ``torch.distributed.pipelining`` on the same model, same run.

Starts ``--stages`` local gloo ranks (file-store rendezvous), one pipeline stage each. The model
is ``--blocks`` residual MLP blocks of width ``--dim`` (``x + W2 gelu(W1 x)``, ``--blocks /
--stages`` per stage, every block seeded by its index so both engines train identical weights)
with an MSE loss. A batch is ``m`` micro-batches of ``--rows`` rows, for each ``m`` in
``--micro-batches`` (default 8 and 32). Modes, each ending with ``SGD.step()``:

* ``ds-pipe 1f1b`` / ``ds-pipe gpipe``: ``ds_pipe.PipelineEngine.train_batch`` (non-blocking
  sends, blocking receives, the loss all-reduce and the global-norm all-reduce included);
* ``torch 1f1b`` / ``torch gpipe``: ``torch.distributed.pipelining.Schedule1F1B`` /
  ``ScheduleGPipe`` over ``PipelineStage`` s of the same blocks.

Rounds alternate the modes (``--rounds`` rounds of ``--steps`` timed batches after one warm-up
batch), so a load spike on a shared machine hits all of them; a mode's step time is the best
round's median of the slowest rank. Throughput is samples per second. The measured bubble is the
fraction of a batch a stage is not computing, ``1 - busy / t_batch``, averaged over the stages,
from one more batch per mode in which forward/backward hooks on the blocks add up the stage's
compute time (the hooks stay out of the timed batches); the theoretical 1F1B/GPipe bubble is
``(p - 1) / (m + p - 1)``. Communication that is not hidden behind compute counts as bubble, so
on a small model or a loaded host the measured bubble exceeds the theoretical one. Target:
ds-pipe's throughput >= torch's for the same schedule.

Usage (from the workspace root)::

    uv run python tools/bench/pipe.py                 # 4 stages, m = 8 and 32 (< 3 min)
    uv run python tools/bench/pipe.py --dim 512 --rows 32
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

MODES = ("ds-pipe 1f1b", "torch 1f1b", "ds-pipe gpipe", "torch gpipe")


class Block(nn.Module):
    """``x + W2 gelu(W1 x)``: the unit of work each stage runs ``blocks / stages`` times."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


def _stage_blocks(args: argparse.Namespace, stage: int) -> nn.Sequential:
    per = args.blocks // args.stages
    blocks = []
    for idx in range(stage * per, (stage + 1) * per):
        torch.manual_seed(1000 + idx)
        blocks.append(Block(args.dim))
    return nn.Sequential(*blocks)


def _ds_pipe_step(args: argparse.Namespace, m: int, schedule: str) -> Callable[..., None]:
    from ds_pipe import LayerSpec, PipelineEngine, PipelineModule

    module = PipelineModule(
        [LayerSpec(Block, args.dim) for _ in range(args.blocks)],
        num_stages=args.stages,
        loss_fn=_mse,
        partition_method="uniform",
    )
    stage = module.stage_id
    with torch.no_grad():  # the same weights as the torch stages
        for p, q in zip(module.parameters(), _stage_blocks(args, stage).parameters()):
            p.copy_(q)
    engine = PipelineEngine(
        module, torch.optim.SGD(module.parameters(), lr=1e-4), micro_batches=m, schedule=schedule
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        engine.train_batch(iter(zip(x.chunk(m), y.chunk(m))))

    step.blocks = [b for b in module.modules() if isinstance(b, Block)]  # type: ignore[attr-defined]
    return step


def _torch_step(args: argparse.Namespace, m: int, schedule: str) -> Callable[..., None]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    blocks = _stage_blocks(args, rank)
    stage = PipelineStage(blocks, rank, args.stages, torch.device("cpu"))
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    sched = cls(stage, m, loss_fn=_mse)
    opt = torch.optim.SGD(blocks.parameters(), lr=1e-4)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        if rank == 0:
            sched.step(x)
        elif rank == args.stages - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step.blocks = list(blocks)  # type: ignore[attr-defined]
    return step


class _Busy:
    """Adds up the time this stage's blocks spend in forward and backward (hooks)."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.total = 0.0
        self._start: dict[tuple[int, str], float] = {}
        self._handles = []
        for b in blocks:
            self._handles += [
                b.register_forward_pre_hook(lambda m, _: self._begin(m, "f")),
                b.register_forward_hook(lambda m, _i, _o: self._end(m, "f")),
                b.register_full_backward_pre_hook(lambda m, _: self._begin(m, "b")),
                b.register_full_backward_hook(lambda m, _i, _o: self._end(m, "b")),
            ]

    def _begin(self, module: nn.Module, kind: str) -> None:
        self._start[(id(module), kind)] = time.perf_counter()

    def _end(self, module: nn.Module, kind: str) -> None:
        self.total += time.perf_counter() - self._start.pop((id(module), kind))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _bubble(step: Callable[..., None], batch: Any, blocks: list[nn.Module]) -> float:
    """``1 - busy / t_batch`` of one instrumented batch, averaged over the stages."""
    busy = _Busy(blocks)
    dist.barrier()
    start = time.perf_counter()
    step(*batch)
    elapsed = time.perf_counter() - start
    busy.remove()
    bubble = torch.tensor([1.0 - busy.total / elapsed])
    dist.all_reduce(bubble)
    return float(bubble) / dist.get_world_size()


def _time(step: Callable[..., None], batches: list[Any]) -> float:
    times = []
    for x, y in batches:
        dist.barrier()
        start = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - start)
    t = torch.tensor([statistics.median(times)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return float(t)


def _rank(rank: int, args: argparse.Namespace, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=args.stages
    )
    results: dict[str, Any] = {}
    for m in args.micro_batches:
        gen = torch.Generator().manual_seed(m)
        rows = m * args.rows
        batches = [
            (torch.randn(rows, args.dim, generator=gen), torch.randn(rows, args.dim, generator=gen))
            for _ in range(args.steps + 1)
        ]
        steps = {
            "ds-pipe 1f1b": _ds_pipe_step(args, m, "1f1b"),
            "torch 1f1b": _torch_step(args, m, "1f1b"),
            "ds-pipe gpipe": _ds_pipe_step(args, m, "gpipe"),
            "torch gpipe": _torch_step(args, m, "gpipe"),
        }
        for step in steps.values():  # warm-up (shape negotiation, allocator)
            step(*batches[0])
        best = {name: math.inf for name in steps}
        for _ in range(args.rounds):
            for name, step in steps.items():
                best[name] = min(best[name], _time(step, batches[1:]))
        bubbles = {name: _bubble(step, batches[0], step.blocks) for name, step in steps.items()}
        results[str(m)] = {"best": best, "bubble": bubbles}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=8, help="a multiple of --stages")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--rows", type=int, default=16, help="rows per micro-batch")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--steps", type=int, default=4, help="timed batches per round")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    if args.blocks % args.stages:
        parser.error(f"--blocks {args.blocks} is not a multiple of --stages {args.stages}")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result")
        mp.spawn(_rank, args=(args, str(Path(tmp) / "store"), out), nprocs=args.stages)
        results = json.loads(Path(out).read_text())
    p = args.stages
    print(
        f"\nds-pipe vs torch.distributed.pipelining: {p} gloo stages, {args.blocks} blocks of "
        f"width {args.dim}, micro-batch {args.rows} rows; best of {args.rounds} rounds x "
        f"{args.steps} batches\n"
    )
    header = (
        f"{'m':>3} {'mode':<14} {'ms/batch':>9} {'samples/s':>10} {'bubble':>7} "
        f"{'theory':>7} {'vs torch':>9} {'target':>7}"
    )
    print(header)
    print("-" * len(header))
    verdicts = []
    for m in args.micro_batches:
        best, bubbles = results[str(m)]["best"], results[str(m)]["bubble"]
        theory = (p - 1) / (m + p - 1)
        for mode in MODES:
            t = best[mode]
            bubble = bubbles[mode]
            schedule = mode.split()[1]
            ratio = best[f"torch {schedule}"] / t  # throughput relative to torch's
            verdict = ""
            if mode.startswith("ds-pipe"):
                verdict = "PASS" if ratio >= 1.0 else "FAIL"
                verdicts.append(verdict)
            print(
                f"{m:>3} {mode:<14} {1e3 * t:>9.1f} {m * args.rows / t:>10.0f} {bubble:>7.1%} "
                f"{theory:>7.1%} {ratio:>8.2f}x {verdict:>7}"
            )
    overall = "met" if all(v == "PASS" for v in verdicts) else "NOT met"
    print(f"\ntarget: ds-pipe throughput >= torch.distributed.pipelining's: {overall}")
    print(f"(ran in {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
