"""Gradient hops: how many ds functions (and files) a gradient passes through from
``engine.backward`` to the weights, per ZeRO stage, measured by tracing one training step.

Two gloo ranks train a small MLP through ``ds_engine.initialize``; after a warm-up step, rank 0
traces one ``engine.backward(loss)`` and one ``engine.step()`` with ``sys.setprofile``, keeping
only Python frames whose code lives in this repository's ``packages/`` or ``kernels/``. Printed
per stage:

* ``hops``: the deepest chain of nested ds calls during ``backward`` (engine entry down to the
  gradient's collective) plus the deepest chain during ``step`` (down to the norm's or the
  weights' collective); each function on a chain is one hop, and a call into ds-comm counts
  as one hop whatever ds-comm does inside (it is the bottom layer, as ``torch.distributed``
  is for FSDP2), so this is the length of the path a gradient is handed along;
* ``files``: the distinct files on those two chains;
* ``functions``/``all files``: every distinct ds function (and file) that ran in the traced
  backward and step (the code a reader must follow, not only the deepest path).

Usage (from the workspace root)::

    uv run python tools/bench/hops.py              # stages 2 and 3
    uv run python tools/bench/hops.py --stages 0 1 2 3 --chains   # print the chains too
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
OURS = (str(ROOT / "packages"), str(ROOT / "kernels"))
COMM = str(ROOT / "packages" / "ds-comm")


def _ours(frame: FrameType) -> bool:
    return frame.f_code.co_filename.startswith(OURS)


def _name(frame: FrameType) -> str:
    path = Path(frame.f_code.co_filename)
    return f"{path.name}:{frame.f_code.co_qualname}"


class Tracer:
    """Records the deepest chain of ds frames and every ds function entered."""

    def __init__(self) -> None:
        self.deepest: list[str] = []
        self.functions: set[str] = set()
        self.files: set[str] = set()

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or not _ours(frame):
            return
        self.functions.add(_name(frame))
        self.files.add(frame.f_code.co_filename)
        frames = []
        f: FrameType | None = frame
        while f is not None:
            if _ours(f):
                frames.append(f)
            f = f.f_back
        chain: list[str] = []
        caller_in_comm = False
        for f in reversed(frames):  # engine entry first
            in_comm = f.f_code.co_filename.startswith(COMM)
            if not (in_comm and caller_in_comm):  # a collective's internals are one hop
                chain.append(_name(f))
            caller_in_comm = in_comm
        if len(chain) > len(self.deepest):
            self.deepest = chain


def _traced(call: Any) -> Tracer:
    tracer = Tracer()
    sys.setprofile(tracer)
    try:
        call()
    finally:
        sys.setprofile(None)
    return tracer


def _rank(rank: int, world: int, stage: int, store: str, out: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    import ds_engine

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = ds_engine.initialize(model=model, config=config)
    x = torch.randn(4, 32)

    def loss() -> torch.Tensor:
        return engine(x).pow(2).mean()

    engine.backward(loss())  # warm up: buffers, optimizer state
    engine.step()
    value = loss()
    backward = _traced(lambda: engine.backward(value))
    step = _traced(engine.step)
    if rank == 0:
        chains = backward.deepest + step.deepest
        files = {c.split(":")[0] for c in chains}
        result = {
            "stage": stage,
            "hops": len(chains),
            "files": len(files),
            "functions": len(backward.functions | step.functions),
            "all_files": len(backward.files | step.files),
            "backward_chain": backward.deepest,
            "step_chain": step.deepest,
        }
        Path(out).write_text(repr(result))
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--chains", action="store_true", help="print the deepest chains")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for stage in args.stages:
            store, out = f"{tmp}/store{stage}", f"{tmp}/out{stage}"
            mp.spawn(_rank, args=(2, stage, store, out), nprocs=2)
            rows.append(eval(Path(out).read_text()))  # our own repr of plain data
    print(f"{'stage':>5} {'hops':>5} {'files':>5} {'functions':>9} {'all files':>9}")
    for r in rows:
        print(
            f"{r['stage']:>5} {r['hops']:>5} {r['files']:>5} {r['functions']:>9} "
            f"{r['all_files']:>9}"
        )
    if args.chains:
        for r in rows:
            print(f"\nstage {r['stage']} backward:\n  " + "\n  ".join(r["backward_chain"]))
            print(f"stage {r['stage']} step:\n  " + "\n  ".join(r["step_chain"]))


if __name__ == "__main__":
    main()
