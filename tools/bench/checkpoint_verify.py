"""What checkpoint verification costs: ``load_checkpoint`` with and without the integrity check.

One process saves a ZeRO-2 engine (a stack of ``--width`` x ``--width`` linear layers, Adam,
``--params`` million parameters) once, then loads it ``--rounds`` times each way, alternating:

* ``verified``: ``engine.load_checkpoint`` as shipped: ``ds_manifest.json`` read, every file's
  16 MiB-chunk CRC-32 checked (on ``min(8, cpus)`` threads), the zero manifest's seal,
  bindings and coverage checked, then the values loaded;
* ``unverified``: the same load with the checks replaced by no-ops (what loading cost before).

The table gives the median of each, the checksum time alone (``verify_directory``), and the
overhead (verified / unverified - 1). The target is under 5% of load time. A first load warms
the page cache, so both measure loads from memory (the worst case for the overhead: a cold
disk makes the load slower and the same check relatively cheaper).

Usage (from the workspace root)::

    uv run python tools/bench/checkpoint_verify.py                  # ~50M params
    uv run python tools/bench/checkpoint_verify.py --params 5 --rounds 3   # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Iterator

import torch


def _engine(params_m: float, width: int):
    import ds_engine

    layers = max(1, round(params_m * 1e6 / (width * width)))
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "steps_per_print": 10**9,
    }
    engine, *_ = ds_engine.initialize(model=model, config=config)
    return engine


@contextlib.contextmanager
def _unverified() -> Iterator[None]:
    """Loading with the integrity checks made no-ops."""
    import ds_engine._checkpoint as engine_ckpt
    import ds_zero._checkpoint as zero_ckpt

    real_dir, real_files = engine_ckpt.verify_directory, zero_ckpt.file_problems
    real_bind = zero_ckpt.binding_problems
    engine_ckpt.verify_directory = lambda *a, **k: {}
    zero_ckpt.file_problems = lambda *a, **k: []
    zero_ckpt.binding_problems = lambda *a, **k: []
    try:
        yield
    finally:
        engine_ckpt.verify_directory, zero_ckpt.file_problems = real_dir, real_files
        zero_ckpt.binding_problems = real_bind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=50.0, help="million parameters")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    from ds_zero import verify_directory

    engine = _engine(args.params, args.width)
    x = torch.randn(2, args.width)
    engine.backward(engine(x).square().mean())
    engine.step()
    with tempfile.TemporaryDirectory() as root:
        engine.save_checkpoint(root, tag="bench")
        folder = os.path.join(root, "bench")
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)
        engine.load_checkpoint(root, tag="bench")  # warm the page cache
        times: dict[str, list[float]] = {"verified": [], "unverified": [], "checksums": []}
        for _ in range(args.rounds):
            start = time.perf_counter()
            engine.load_checkpoint(root, tag="bench")
            times["verified"].append(time.perf_counter() - start)
            with _unverified():
                start = time.perf_counter()
                engine.load_checkpoint(root, tag="bench")
                times["unverified"].append(time.perf_counter() - start)
            start = time.perf_counter()
            verify_directory(folder)
            times["checksums"].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    params = sum(p.numel() for p in engine.module.parameters())
    print(
        f"{params / 1e6:.1f}M parameters, checkpoint {size / 2**20:.0f} MiB, "
        f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
        f"median of {args.rounds}"
    )
    print("| load | seconds | MiB/s |")
    print("|---|---|---|")
    for key in ("unverified", "verified", "checksums"):
        print(f"| {key} | {med[key]:.3f} | {size / 2**20 / med[key]:.0f} |")
    print(f"| overhead | {100 * (med['verified'] / med['unverified'] - 1):+.1f}% | |")


if __name__ == "__main__":
    main()
