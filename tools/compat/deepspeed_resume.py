"""Real DeepSpeed resumes a checkpoint ds wrote in DeepSpeed's layout, and prints its next losses.

Run it with the interpreter that has DeepSpeed installed (CPU, gloo; no GPU needed)::

    DS_ACCELERATOR=cpu /tmp/dsref/bin/python tools/compat/deepspeed_resume.py <save_dir> \
        --model net --world 2 --stage 1 --dtype fp32 --steps 2

It builds the model of ``make_deepspeed_checkpoints.py`` (same layers, data and config) from a
seed the checkpoint must overwrite, calls DeepSpeed's ``engine.load_checkpoint(save_dir)``, trains
``--steps`` steps from the loaded global step and prints ``RESULT {json}`` (the losses, each
averaged over the global batch, the first step, the client state and the learning rate).

``--model``: ``net`` (the fixtures' MLP, one param group), ``groups`` (the same MLP with weights
and biases in two param groups of different weight decay, see :func:`param_groups`), ``pipe``
(the one-stage ``PipelineModule``), ``pipe2`` (the same layers in two pipeline stages, one
data-parallel rank each), ``moe`` (the MoE model, ``ep_size`` = world size), ``moe-ep1`` (the
same at ``ep_size`` 1) or ``moe-multi`` (two MoE layers at ``ep_size`` 1 and 2, expert groups
in module order, see ``make_deepspeed_checkpoints.moe_param_groups``).

This script is not imported by ds; ds's tests run it (``tests/test_deepspeed_write.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

_spec = importlib.util.spec_from_file_location(
    "make_deepspeed_checkpoints", Path(__file__).with_name("make_deepspeed_checkpoints.py")
)
assert _spec is not None and _spec.loader is not None
maker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(maker)

MODELS = ("net", "groups", "pipe", "pipe2", "moe", "moe-ep1", "moe-multi")
CLIENT_KEYS = ("epoch", "note", "ids")


def param_groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Weights (weight decay 0.01) and biases (no weight decay): two param groups, members in
    ``named_parameters()`` order. ds's tests build the same groups."""
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": 0.01},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
    ]


def build(model: str, stage: int, dtype: str, world: int, universal: bool = False):
    """A fresh DeepSpeed engine for ``model``, seeded away from the checkpoint's values
    (``universal``: with ``checkpoint.load_universal``)."""
    import deepspeed

    # pipe2: one data-parallel rank, so the whole global batch is one micro-batch
    cfg = maker.config(stage, dtype, 1 if model == "pipe2" else world)
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    torch.manual_seed(99)
    if model in ("pipe", "pipe2"):
        module = maker._pipe_model(num_stages=2 if model == "pipe2" else 1)
        params: Any = module.parameters()
    elif model.startswith("moe"):
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        if model == "moe-multi":
            module = maker.MultiMoENet()
        else:
            module = maker.MoENet(ep_size=1 if model == "moe-ep1" else world)
        params = maker.moe_param_groups(
            module, split_params_into_different_moe_groups_for_optimizer
        )
    else:
        module = maker.Net()
        params = param_groups(module) if model == "groups" else module.parameters()
    engine, *_ = deepspeed.initialize(model=module, model_parameters=params, config=cfg)
    return engine


def _train(engine, model: str, first: int, steps: int, rank: int, world: int, dtype: str):
    if not model.startswith("pipe"):
        return maker._steps(engine, first, steps, rank, world, dtype)
    losses = []
    dp_rank, dp_world = (0, 1) if model == "pipe2" else (rank, world)
    for step in range(first, first + steps):
        data = iter([maker.batch(step, dp_rank, dp_world)])
        losses.append(maker._mean(engine.train_batch(data_iter=data), world))
    return losses


def _worker(rank: int, world: int, args: dict, port: int, queue) -> None:
    maker.init_deepspeed_rank(rank, world, port)
    try:
        engine = build(args["model"], args["stage"], args["dtype"], world, args["universal"])
        path, client = engine.load_checkpoint(args["load"], tag=None)
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint under {args['load']}")
        first = engine.global_steps
        losses = _train(engine, args["model"], first, args["steps"], rank, world, args["dtype"])
        result = {
            "first_step": first,
            "losses": losses,
            "client_state": {k: v for k, v in (client or {}).items() if k in CLIENT_KEYS},
            "lr": engine.get_lr()[0],
        }
    except Exception as exc:  # reported to the caller, which fails (or skips) with it
        import traceback

        traceback.print_exc()
        queue.put({"error": f"rank {rank}: {type(exc).__name__}: {exc}"[:2000]})
        return
    if rank == 0:
        queue.put(result)


def resume(
    load: str, model: str, world: int, stage: int, dtype: str, steps: int, universal: bool = False
) -> dict:
    """DeepSpeed resumes ``load`` on ``world`` ranks: its next ``steps`` losses."""
    args = {"load": load, "model": model, "stage": stage, "dtype": dtype, "steps": steps}
    args["universal"] = universal
    return maker.run_ranks(_worker, world, args, 29300 + os.getpid() % 300)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("load")
    parser.add_argument("--model", default="net", choices=MODELS)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--dtype", default="fp32", choices=maker.DTYPES)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--universal", action="store_true", help="load the universal folder latest_universal names"
    )
    args = parser.parse_args()
    result = resume(
        args.load, args.model, args.world, args.stage, args.dtype, args.steps, args.universal
    )
    print("RESULT " + json.dumps(result))
    sys.exit(1 if "error" in result else 0)


if __name__ == "__main__":
    main()
