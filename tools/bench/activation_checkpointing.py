"""Activation checkpointing's memory saving on the example GPT, next to the same step without it.

Each mode trains the example GPT (``tools/examples/gpt/train.py``) from the same seed on the same
token batches, one process, and reports per step the peak memory above what was live when the
step started (activations, plus the gradients and temporaries every mode shares) and the
median step time:

* ``none``: plain forward/backward;
* ``checkpoint``: every block through ``deepspeed.checkpointing.checkpoint`` (ds_engine's);
* ``cpu_checkpointing``: the same with ``cpu_checkpointing`` (saved inputs in host memory);
* ``non_reentrant``: ``deepspeed.checkpointing.non_reentrant_checkpoint``.

On a GPU the peak is ``torch.cuda.max_memory_allocated``. On the CPU, which has no allocator
statistics, a ``TorchDispatchMode`` records every storage an operator creates and a finalizer
on each drops it when freed, so the peak is the largest sum of live storages' bytes (the
``cpu_checkpointing`` copies live on the same host memory there, so that mode saves nothing
on CPU: its saving is device memory).

Usage (from the workspace root)::

    uv run python tools/bench/activation_checkpointing.py
    uv run python tools/bench/activation_checkpointing.py --layers 12 --seq 256 --dim 256
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _shared.live_bytes import (
    LiveBytes,  # tools/bench/_shared (this script's folder is on sys.path)
)

from ds_comm.accelerator import get_accelerator
from ds_engine import checkpointing

MODES = ("none", "checkpoint", "cpu_checkpointing", "non_reentrant")


def _gpt_module() -> Any:
    path = Path(__file__).parents[1] / "examples" / "gpt" / "train.py"
    spec = importlib.util.spec_from_file_location("gpt_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wrap_blocks(model: torch.nn.Module, mode: str) -> None:
    """Route every block's forward through the mode's checkpoint function."""
    if mode == "none":
        return
    ckpt: Callable[..., Any] = (
        checkpointing.non_reentrant_checkpoint
        if mode == "non_reentrant"
        else checkpointing.checkpoint
    )
    for block in model.blocks:  # type: ignore[attr-defined]
        inner = block.forward
        block.forward = lambda x, inner=inner: ckpt(inner, x)


def run_mode(mode: str, args: argparse.Namespace) -> tuple[float, float, float]:
    """(peak MiB per step, median step ms, last loss) of ``mode``."""
    gpt = _gpt_module()
    device = torch.device(get_accelerator().current_device_name())
    checkpointing.configure(None, checkpoint_in_cpu=mode == "cpu_checkpointing")
    torch.manual_seed(0)
    model = gpt.GPT(args.vocab, args.seq, args.dim, args.layers, args.heads).to(device)
    _wrap_blocks(model, mode)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = gpt.CountingLanguage(args.batch * (args.steps + 1), args.vocab, args.seq, seed=1)
    peaks, times, loss = [], [], float("nan")
    for step in range(args.steps + 1):
        tokens = data.tokens[step * args.batch : (step + 1) * args.batch].to(device)
        start = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss_t = model(tokens)
            loss_t.backward()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
        else:
            with LiveBytes() as tracker:
                loss_t = model(tokens)
                loss_t.backward()
            peak = tracker.peak
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        loss = loss_t.item()
        if step > 0:  # the first step allocates optimizer state
            peaks.append(peak / 2**20)
            times.append(elapsed * 1000)
    checkpointing.configure(None)
    return max(peaks), statistics.median(times), loss


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="activation checkpointing memory bench")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args(argv)
    device = get_accelerator().current_device_name()
    print(
        f"example GPT: {args.layers} layers, dim {args.dim}, seq {args.seq}, batch {args.batch}, "
        f"vocab {args.vocab}; device {device}; {args.steps} steps per mode"
    )
    print(f"{'mode':<20}{'peak MiB/step':>15}{'vs none':>10}{'step ms':>10}{'vs none':>10}")
    base: tuple[float, float] | None = None
    losses = []
    for mode in args.modes.split(","):
        peak, ms, loss = run_mode(mode, args)
        losses.append(loss)
        if base is None:
            base = (peak, ms)
        print(f"{mode:<20}{peak:>15.1f}{peak / base[0]:>10.2f}{ms:>10.1f}{ms / base[1]:>10.2f}")
    print(f"last losses (equal: the same training): {', '.join(f'{x:.6f}' for x in losses)}")


if __name__ == "__main__":
    main()
