"""Write universal checkpoints with real DeepSpeed's ``ds_to_universal``, for ds's universal-load tests.

Run it with the interpreter that has DeepSpeed installed (CPU, gloo; no GPU needed)::

    DS_ACCELERATOR=cpu /tmp/dsref/bin/python tools/compat/make_universal_checkpoint.py \
        packages/ds-engine/tests/fixtures/universal_0.19.8

For each case (ZeRO stage 2, fp32, 2 ranks) it trains ``TRAIN_STEPS`` steps of a tiny MLP,
saves a checkpoint, records the next ``RESUME_STEPS`` losses of the same run (``continued``),
converts the checkpoint with ``python -m deepspeed.checkpoint.ds_to_universal
--inject_missing_state`` into ``<out>/<case>/step3_universal`` (``latest_universal`` beside it),
then loads that folder into a fresh 1-rank engine (``checkpoint.load_universal: true``, ZeRO
stage 1) and records the losses DeepSpeed computes from there (``resumed``). Everything goes
to ``<out>/expected.json``, with the model, data and config written out in full. Every loss is
the mean over the whole global batch, so it does not depend on the number of ranks.

``... make_universal_checkpoint.py resume <load_dir> --world W --stage S`` instead makes
DeepSpeed load the universal folder ``<load_dir>/latest_universal`` names (one ``ds-to-universal``
wrote, in ds's tests) with ``checkpoint.load_universal`` on ``W`` ranks at ZeRO stage ``S``,
train ``RESUME_STEPS`` steps and print ``RESULT {json}`` (the losses, the global step it resumed
at, the learning rate).

This script is not imported by ds; it exists so the fixtures can be regenerated and audited.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

_spec = importlib.util.spec_from_file_location(
    "make_deepspeed_checkpoints", Path(__file__).with_name("make_deepspeed_checkpoints.py")
)
assert _spec is not None and _spec.loader is not None
maker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(maker)

TRAIN_STEPS, RESUME_STEPS, GLOBAL_BATCH = 3, 3, 8
IN, HIDDEN, OUT = 6, 10, 3
# case: (stage, world size) saved, then (stage, world size) DeepSpeed resumes the universal folder
# at. DeepSpeed 0.19.8 on CPU could not resume the stage-3 universal folder its own ds_to_universal
# wrote (load_checkpoint finds no model-states file), so that case records no "resumed" losses:
# ds's test compares with the uninterrupted run's.
CASES = {"zero2_w2": ((2, 2), (1, 1)), "zero3_w2": ((3, 2), None)}


class Net(torch.nn.Module):
    """Two linear layers and a loss (odd element counts, so partitions are padded)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((self.fc2(torch.tanh(self.fc1(x))) - y) ** 2).mean()


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch ``step`` (seeded by the step), this rank's contiguous slice of it."""
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = (
        torch.randn(GLOBAL_BATCH, IN, generator=gen),
        torch.randn(GLOBAL_BATCH, OUT, generator=gen),
    )
    rows = GLOBAL_BATCH // world
    return x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]


def config(stage: int, world: int, universal: bool = False) -> dict:
    return {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "checkpoint": {"load_universal": universal},
        "steps_per_print": 1000,
    }


def _steps(engine, first: int, rank: int, world: int) -> list[float]:
    import torch.distributed as dist

    losses = []
    for step in range(first, first + RESUME_STEPS if first else TRAIN_STEPS):
        loss = engine(*batch(step, rank, world))
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def _worker(rank: int, world: int, job: dict, port: int, queue) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0 if job["kind"] == "train" else 7)
    model = Net()
    universal = job["kind"] == "resume"
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=config(job["stage"], world, universal),
    )
    out: dict = {}
    if job["kind"] == "train":
        out["losses"] = _steps(engine, 0, rank, world)
        engine.save_checkpoint(job["save_dir"], tag=f"step{TRAIN_STEPS}")
        out["continued"] = _steps(engine, TRAIN_STEPS, rank, world)
    else:
        engine.load_checkpoint(job["save_dir"])
        out["first_step"] = engine.global_steps
        out["resumed"] = _steps(engine, TRAIN_STEPS, rank, world)
        out["lr"] = engine.get_lr()[0]
    if rank == 0:
        queue.put(out)
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def _run(world: int, job: dict, port: int) -> dict:
    result = maker.run_ranks(_worker, world, job, port)
    if "error" in result:
        raise RuntimeError(result["error"])
    return result


def resume_universal() -> None:
    """DeepSpeed resumes a universal folder (``resume <load_dir> --world W --stage S``)."""
    import argparse

    parser = argparse.ArgumentParser(description="DeepSpeed loads a universal checkpoint")
    parser.add_argument("load_dir")
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--stage", type=int, required=True)
    args = parser.parse_args(sys.argv[2:])
    job = {"kind": "resume", "stage": args.stage, "save_dir": args.load_dir}
    result = _run(args.world, job, 29700 + os.getpid() % 200)
    print("RESULT " + json.dumps(result))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "resume":
        resume_universal()
        return
    import deepspeed

    out = Path(sys.argv[1])
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    expected: dict = {
        "deepspeed": deepspeed.__version__,
        "torch": torch.__version__,
        "model": f"Linear({IN},{HIDDEN}) -> tanh -> Linear({HIDDEN},{OUT}); loss: mean squared error",
        "data": "step s: torch.Generator().manual_seed(1000 + s); x = randn(8, 6); y = randn(8, 3)",
        "cases": {},
    }
    for i, (case, ((stage, world), resume)) in enumerate(CASES.items()):
        with tempfile.TemporaryDirectory() as tmp:
            save_dir = Path(tmp) / "ckpt"
            trained = _run(
                world, {"kind": "train", "stage": stage, "save_dir": str(save_dir)}, 29600 + i
            )
            target = out / case / f"step{TRAIN_STEPS}_universal"
            target.parent.mkdir(parents=True)
            command = [
                sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
                "--input_folder", str(save_dir / f"step{TRAIN_STEPS}"),
                "--output_folder", str(target), "--inject_missing_state",
                "--num_extract_workers", "1", "--num_merge_workers", "1",
            ]  # fmt: skip
            subprocess.run(command, check=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
        resumed = {}
        if resume is not None:
            job = {"kind": "resume", "stage": resume[0], "save_dir": str(out / case)}
            resumed = _run(resume[1], job, 29650 + i)
        expected["cases"][case] = {
            "stage": stage,
            "world_size": world,
            "config": config(stage, world),
            "resume": resume
            and {"stage": resume[0], "world_size": resume[1], "config": config(*resume, True)},
            **trained,
            **resumed,
        }
    (out / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main()
