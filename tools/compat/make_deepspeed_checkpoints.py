"""Write checkpoints with real DeepSpeed, for ds's cross-loading tests.

``... make_deepspeed_checkpoints.py resume <save_dir> --world W --stage S --dtype D`` instead
makes DeepSpeed resume a checkpoint (one ds wrote, in the round-trip tests) and print its next
losses as ``RESULT {json}``.

Run it with the interpreter that has DeepSpeed installed (CPU, gloo; no GPU needed)::

    DS_ACCELERATOR=cpu /tmp/dsref/bin/python tools/compat/make_deepspeed_checkpoints.py \
        packages/ds-engine/tests/fixtures/deepspeed_0.19.8

For each case (ZeRO stage 0-3 x fp32/bf16/fp16 x 1 and 2 ranks, a pipeline module, an MoE model)
it trains ``TRAIN_STEPS`` steps, saves a checkpoint (with a WarmupLR schedule and a client state)
under ``<out>/<case>/``, then builds a fresh engine from a differently seeded model, loads the
checkpoint and records the next ``RESUME_STEPS`` losses DeepSpeed computes. The losses (and what
each case holds) go to ``<out>/expected.json``. Every loss is the mean over the whole global
batch (each rank computes its half and the halves are averaged), so the trajectory does not
depend on the number of ranks. The model, data and configuration are written out in full in
``expected.json`` so a reader can rebuild them without this script.

This script is not imported by ds; it exists so the fixtures can be regenerated and audited.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any

import torch

TRAIN_STEPS = 3
RESUME_STEPS = 3
GLOBAL_BATCH = 8
IN, HIDDEN, MID, OUT = 8, 15, 16, 4
DTYPES = ("fp32", "bf16", "fp16")
STAGES = (0, 1, 2, 3)
MOE_STAGES = (0, 2)


class Net(torch.nn.Module):
    """Three linear layers (one with an odd element count, so partitions are padded)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, MID)
        self.fc3 = torch.nn.Linear(MID, OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.fc2(h))
        return ((self.fc3(h).float() - y.float()) ** 2).mean()


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch ``step`` (seeded by the step), this rank's contiguous slice of it."""
    g = torch.Generator().manual_seed(1234 + step)
    x = torch.randn(GLOBAL_BATCH, IN, generator=g)
    y = torch.randn(GLOBAL_BATCH, OUT, generator=g)
    per = GLOBAL_BATCH // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def config(stage: int, dtype: str, world: int) -> dict:
    cfg = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 5},
        },
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**6,
        "wall_clock_breakdown": False,
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    return cfg


def _mean(loss: torch.Tensor, world: int) -> float:
    value = loss.detach().float().clone()
    torch.distributed.all_reduce(value)
    return value.item() / world


def _dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def _steps(engine, first: int, count: int, rank: int, world: int, dtype: str) -> list[float]:
    losses = []
    for step in range(first, first + count):
        x, y = batch(step, rank, world)
        loss = engine(x.to(_dtype(dtype)), y)
        engine.backward(loss)
        engine.step()
        losses.append(_mean(loss, world))
    return losses


CLIENT_STATE = {"epoch": 7, "note": "from deepspeed", "ids": [1, 2, 3]}


def run_zero_case(out: Path, stage: int, dtype: str, rank: int, world: int) -> dict:
    import deepspeed

    name = f"zero{stage}_{dtype}_w{world}"
    save_dir = out / name
    torch.manual_seed(0)
    model = Net()
    cfg = config(stage, dtype, world)
    # A copy each time: DeepSpeed 0.16's initialize pops keys (``torch_adam``) out of the config.
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=copy.deepcopy(cfg)
    )
    trained = _steps(engine, 0, TRAIN_STEPS, rank, world, dtype)
    engine.save_checkpoint(str(save_dir), tag="step3", client_state=CLIENT_STATE)
    continued = _steps(engine, TRAIN_STEPS, RESUME_STEPS, rank, world, dtype)
    torch.distributed.barrier()
    torch.manual_seed(99)  # a different start: the checkpoint must overwrite it
    fresh = Net()
    engine2, *_ = deepspeed.initialize(
        model=fresh, model_parameters=fresh.parameters(), config=copy.deepcopy(cfg)
    )
    _, client = engine2.load_checkpoint(str(save_dir), tag=None)
    resumed = _steps(engine2, TRAIN_STEPS, RESUME_STEPS, rank, world, dtype)
    return {
        "case": name,
        "kind": "zero",
        "stage": stage,
        "dtype": dtype,
        "world_size": world,
        "config": cfg,
        "train_losses": trained,
        "continued_losses": continued,
        "resumed_losses": resumed,
        "client_state": {k: client[k] for k in CLIENT_STATE} if client else None,
        "global_steps_after_resume": engine2.global_steps,
        "skipped_steps_after_resume": engine2.skipped_steps,
        "loss_scale_after_resume": (
            float(engine2.optimizer.cur_scale)
            if dtype == "fp16" and hasattr(engine2.optimizer, "cur_scale")
            else None
        ),
    }


def _pipe_model(num_stages: int = 1):
    from deepspeed.pipe import LayerSpec, PipelineModule

    def loss_fn(out, y):
        return ((out.float() - y.float()) ** 2).mean()

    layers = [
        LayerSpec(torch.nn.Linear, IN, HIDDEN),
        torch.nn.Tanh(),
        LayerSpec(torch.nn.Linear, HIDDEN, MID),
        torch.nn.Tanh(),
        LayerSpec(torch.nn.Linear, MID, OUT),
    ]
    # "uniform": one layer boundary whatever the parameter counts (ds's tests cut the same way)
    return PipelineModule(
        layers=layers, num_stages=num_stages, loss_fn=loss_fn, partition_method="uniform"
    )


def run_pipe_case(out: Path, rank: int, world: int) -> dict:
    """A one-stage pipeline replicated over ``world`` data-parallel ranks (layer files)."""
    import deepspeed

    name = f"pipe_w{world}"
    save_dir = out / name
    cfg = config(1, "fp32", world)

    def build(seed: int):
        torch.manual_seed(seed)
        model = _pipe_model()
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=copy.deepcopy(cfg)
        )
        return engine

    def steps(engine, first: int) -> list[float]:
        losses = []
        for step in range(first, first + (RESUME_STEPS if first else TRAIN_STEPS)):
            data = iter([batch(step, rank, world)])
            losses.append(_mean(engine.train_batch(data_iter=data), world))
        return losses

    engine = build(0)
    trained = steps(engine, 0)
    engine.save_checkpoint(str(save_dir), tag="step3", client_state=CLIENT_STATE)
    torch.distributed.barrier()
    engine2 = build(99)
    _, client = engine2.load_checkpoint(str(save_dir), tag=None)
    resumed = steps(engine2, TRAIN_STEPS)
    return {
        "case": name,
        "kind": "pipe",
        "stage": 1,
        "dtype": "fp32",
        "world_size": world,
        "config": cfg,
        "train_losses": trained,
        "resumed_losses": resumed,
        "client_state": {k: client[k] for k in CLIENT_STATE} if client else None,
        "global_steps_after_resume": engine2.global_steps,
    }


class MoENet(torch.nn.Module):
    """fc1, an MoE layer of two linear experts (top-1 gate), fc3."""

    def __init__(self, ep_size: int) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.fc1 = torch.nn.Linear(IN, MID)
        expert = torch.nn.Linear(MID, MID)
        self.moe = MoE(hidden_size=MID, expert=expert, num_experts=2, ep_size=ep_size, k=1)
        self.fc3 = torch.nn.Linear(MID, OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        h, _, _ = self.moe(h)
        return ((self.fc3(torch.tanh(h)).float() - y.float()) ** 2).mean()


class MultiMoENet(torch.nn.Module):
    """fc1, an MoE layer of two experts at ``ep_size`` 1, one of four experts at ``ep_size`` 2
    (top-1 gates), fc3: two expert param groups (``ep_size_1``, ``ep_size_2``)."""

    def __init__(self) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.fc1 = torch.nn.Linear(IN, MID)
        self.moe_a = MoE(MID, torch.nn.Linear(MID, MID), num_experts=2, ep_size=1, k=1)
        self.moe_b = MoE(MID, torch.nn.Linear(MID, MID), num_experts=4, ep_size=2, k=1)
        self.fc3 = torch.nn.Linear(MID, OUT)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        h = torch.tanh(self.moe_a(h)[0])
        h = torch.tanh(self.moe_b(h)[0])
        return ((self.fc3(h).float() - y.float()) ** 2).mean()


def moe_param_groups(model: torch.nn.Module, split) -> list[dict]:
    """``split`` (DeepSpeed's ``split_params_into_different_moe_groups_for_optimizer``) of all
    of ``model``'s parameters, the expert groups put in the order their first parameter has in
    ``model.parameters()``: DeepSpeed orders several ``ep_size`` groups by iterating a set, which
    changes with the interpreter's hash seed; ds keeps module order."""
    groups = split({"params": list(model.parameters()), "name": "params"})
    first = {id(p): i for i, p in enumerate(model.parameters())}
    dense = [g for g in groups if not g.get("moe")]
    experts = sorted((g for g in groups if g.get("moe")), key=lambda g: first[id(g["params"][0])])
    return dense + experts


def moe_case_name(stage: int, world: int) -> str:
    """``moe_w2`` at stage 0 (its first name), ``moe_zero<S>_w2`` at ZeRO stage S."""
    return f"moe_w{world}" if stage == 0 else f"moe_zero{stage}_w{world}"


def run_moe_case(out: Path, rank: int, world: int, stage: int = 0) -> dict:
    """Expert-parallel size ``world`` (one expert per rank on 2 ranks): the expert weights in
    ``layer_0_expert_<E>_...`` files, their optimizer state in ``expp_rank_<r>_...`` files
    (stage 0) or in the ZeRO files of each rank (stages 1-2)."""
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    name = moe_case_name(stage, world)
    save_dir = out / name
    cfg = config(stage, "fp32", world)

    def build(seed: int):
        torch.manual_seed(seed)
        model = MoENet(ep_size=world)
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(model.parameters()), "name": "params"}
        )
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=groups, config=copy.deepcopy(cfg)
        )
        return engine

    engine = build(0)
    trained = _steps(engine, 0, TRAIN_STEPS, rank, world, "fp32")
    engine.save_checkpoint(str(save_dir), tag="step3", client_state=CLIENT_STATE)
    continued = _steps(engine, TRAIN_STEPS, RESUME_STEPS, rank, world, "fp32")
    torch.distributed.barrier()
    engine2 = build(99)
    _, client = engine2.load_checkpoint(str(save_dir), tag=None)
    resumed = _steps(engine2, TRAIN_STEPS, RESUME_STEPS, rank, world, "fp32")
    return {
        "case": name,
        "kind": "moe",
        "stage": stage,
        "continued_losses": continued,
        "dtype": "fp32",
        "world_size": world,
        "config": cfg,
        "train_losses": trained,
        "resumed_losses": resumed,
        "client_state": {k: client[k] for k in CLIENT_STATE} if client else None,
        "global_steps_after_resume": engine2.global_steps,
    }


def init_deepspeed_rank(rank: int, world: int, port: int) -> types.ModuleType:
    """Make this process rank ``rank`` of ``world`` local gloo ranks; DeepSpeed, initialised."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    return deepspeed


def _worker(rank: int, world: int, out: str, port: int, only: str | None, queue) -> None:
    init_deepspeed_rank(rank, world, port)
    root = Path(out)
    cases = [("zero", s, d) for s in STAGES for d in DTYPES] + [("pipe", 1, "")]
    cases += [("moe", s, "") for s in MOE_STAGES]
    results = []
    for kind, stage, dtype in cases:
        label = {
            "zero": f"zero{stage}_{dtype}_w{world}",
            "pipe": f"pipe_w{world}",
            "moe": moe_case_name(stage, world),
        }[kind]
        if only and only not in label:
            continue
        try:
            if kind == "zero":
                results.append(run_zero_case(root, stage, dtype, rank, world))
            elif kind == "pipe":
                results.append(run_pipe_case(root, rank, world))
            else:
                results.append(run_moe_case(root, rank, world, stage))
        except Exception as exc:  # recorded: a case DeepSpeed refuses on CPU
            traceback.print_exc()
            results.append({"case": label, "error": f"{type(exc).__name__}: {exc}"[:500]})
            shutil.rmtree(root / label, ignore_errors=True)
        torch.distributed.barrier()
    if rank == 0:
        queue.put(results)


def _resume_worker(rank: int, world: int, args: dict, port: int, queue) -> None:
    """Resume ``args["load"]`` in DeepSpeed and train ``args["steps"]`` steps; rank 0 reports
    the losses, and a rank that fails reports its error (so the caller stops waiting)."""
    deepspeed = init_deepspeed_rank(rank, world, port)
    try:
        cfg = config(args["stage"], args["dtype"], world)
        torch.manual_seed(99)
        model = Net()
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=cfg
        )
        _, client = engine.load_checkpoint(args["load"], tag=None)
        first = engine.global_steps
        losses = _steps(engine, first, args["steps"], rank, world, args["dtype"])
    except Exception as exc:  # reported to the caller, which fails (or skips) with it
        traceback.print_exc()
        queue.put({"error": f"rank {rank}: {type(exc).__name__}: {exc}"[:2000]})
        return
    if rank == 0:
        queue.put(
            {
                "first_step": first,
                "losses": losses,
                "client_state": {k: v for k, v in (client or {}).items() if k in CLIENT_STATE},
                "lr": engine.get_lr()[0],
            }
        )


def run_ranks(target, world: int, *args: Any, timeout: float = 600) -> Any:
    """``target(rank, world, *args, queue)`` in ``world`` spawned processes, and what rank 0
    puts on the queue. A rank that exits with an error before that stops the wait at once (the
    others are killed) with a RuntimeError naming it and its exit code; a rank 0 that reports
    nothing in ``timeout`` seconds raises TimeoutError naming the ranks still running. (A bare
    ``queue.get`` waited its whole 600 s after DeepSpeed refused a config on both ranks.)"""
    import queue as queue_lib

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                result = queue.get(timeout=1)
                break
            except queue_lib.Empty:
                failed = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
                if failed:
                    raise RuntimeError(f"rank(s) exited before rank 0 reported: {failed}") from None
                if all(p.exitcode is not None for p in procs) and queue.empty():
                    raise RuntimeError("every rank exited without reporting") from None
                if time.monotonic() > deadline:
                    running = [r for r, p in enumerate(procs) if p.exitcode is None]
                    raise TimeoutError(
                        f"no result from rank 0 in {timeout:.0f} s; running: {running}"
                    ) from None
        if not (isinstance(result, dict) and "error" in result):  # else a rank may hang
            for p in procs:
                p.join(timeout=120)
            failed = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
            if failed:
                raise RuntimeError(f"rank(s) failed after rank 0 reported: {failed}")
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
    return result


def resume(load: str, world: int, stage: int, dtype: str, steps: int) -> dict:
    """DeepSpeed resumes the checkpoint ``load`` on ``world`` ranks: its next losses."""
    args = {"load": load, "stage": stage, "dtype": dtype, "steps": steps}
    return run_ranks(_resume_worker, world, args, 29700 + os.getpid() % 200)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "resume":
        parser = argparse.ArgumentParser(description="DeepSpeed resumes a checkpoint")
        parser.add_argument("load")
        parser.add_argument("--world", type=int, required=True)
        parser.add_argument("--stage", type=int, required=True)
        parser.add_argument("--dtype", default="fp32", choices=DTYPES)
        parser.add_argument("--steps", type=int, default=2)
        args = parser.parse_args(sys.argv[2:])
        result = resume(args.load, args.world, args.stage, args.dtype, args.steps)
        print("RESULT " + json.dumps(result))
        return
    generate()


def generate() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--only", default=None, help="only cases whose name contains this")
    args = parser.parse_args()
    import deepspeed

    args.out.mkdir(parents=True, exist_ok=True)
    expected = args.out / "expected.json"
    record = json.loads(expected.read_text()) if expected.exists() else {"cases": {}}
    record.update(
        deepspeed_version=deepspeed.__version__,
        torch_version=torch.__version__,
        script="tools/compat/make_deepspeed_checkpoints.py",
        model="Net: fc1 Linear(8, 15), tanh, fc2 Linear(15, 16), tanh, fc3 Linear(16, 4); "
        "loss = mean squared error in fp32 of fc3's output against y",
        data="step s: g = torch.Generator().manual_seed(1234 + s); x = randn(8, 8, g); "
        "y = randn(8, 4, g); rank r of W takes rows [r*8/W, (r+1)*8/W)",
        train_steps=TRAIN_STEPS,
        resume_steps=RESUME_STEPS,
        client_state=CLIENT_STATE,
    )
    for port, world in ((29611, 1), (29612, 2)):
        results = run_ranks(_worker, world, str(args.out), port, args.only, timeout=3600)
        for case in results:
            record["cases"][case["case"]] = case
    expected.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(json.dumps({k: v.get("error", "ok") for k, v in record["cases"].items()}, indent=1))
    sys.exit(0)


if __name__ == "__main__":
    main()
