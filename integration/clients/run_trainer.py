"""Hugging Face ``Trainer`` on DeepSpeed, one scenario per run, 2 ranks under ``torchrun``.

    python -m torch.distributed.run --nproc_per_node 2 run_trainer.py --scenario zero2 --out DIR

Scenarios: ``zero2`` (also saves ``checkpoint-10`` and ``save_model()`` to ``DIR/final``),
``zero3`` (the model is built after ``TrainingArguments``, so through ``HfDeepSpeedConfig`` and
``deepspeed.zero.Init``; also saves a model), ``offload`` (ZeRO-2, optimizer offloaded to the CPU,
DeepSpeed's CPU Adam), ``bf16`` (ZeRO-2 in bf16), ``resume`` (``--resume-from DIR/checkpoint-10``
of a ``zero2`` run; records steps 11-20). The config is the one Hugging Face documents, full of
``"auto"`` values that the Trainer fills in.

Each rank writes ``DIR/result.rank<r>.json`` with its per-step losses (the value each
``training_step`` returned, before any cross-rank averaging or rounding).
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import _scenario
import torch

BASE_CONFIG: dict[str, Any] = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {
        "type": "AdamW",
        "params": {
            "lr": "auto",
            "betas": "auto",
            "eps": "auto",
            "weight_decay": "auto",
            "torch_adam": True,
        },
    },
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 2,
        "overlap_comm": False,
        "contiguous_gradients": True,
        "reduce_bucket_size": "auto",
    },
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
    "steps_per_print": 1000,
    "wall_clock_breakdown": False,
}

ZERO3 = {
    "stage": 3,
    "overlap_comm": False,
    "contiguous_gradients": True,
    "reduce_bucket_size": "auto",
    "stage3_prefetch_bucket_size": "auto",
    "stage3_param_persistence_threshold": "auto",
    "stage3_gather_16bit_weights_on_model_save": True,
}


def ds_config(scenario: str) -> dict[str, Any]:
    """The DeepSpeed config for ``scenario``, with the ``"auto"`` values left for the Trainer."""
    config = copy.deepcopy(BASE_CONFIG)
    if scenario == "zero3":
        config["zero_optimization"] = dict(ZERO3)
    if scenario == "offload":
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        del config["optimizer"]["params"]["torch_adam"]
    return config


class RecordingTrainer:
    """Builds a ``Trainer`` subclass that keeps the loss each training step returns."""

    @staticmethod
    def make(**kwargs: Any) -> Any:
        from transformers import Trainer

        class _Trainer(Trainer):
            losses: list[float]

            def training_step(self, *args: Any, **kw: Any) -> torch.Tensor:
                loss = super().training_step(*args, **kw)
                self.losses.append(float(loss.detach().float().item()))
                return loss

        trainer = _Trainer(**kwargs)
        trainer.losses = []
        return trainer


def partition_summary(model: torch.nn.Module) -> dict[str, int]:
    """How many parameter elements this rank holds locally vs the model's full size."""
    local = sum(p.numel() for p in model.parameters())
    full = sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters())
    return {"local_numel": local, "full_numel": full}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--scenario", required=True, choices=["zero2", "zero3", "offload", "bf16", "resume"]
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume-from", default=None)
    args = parser.parse_args()
    out = Path(args.out)

    # A CPU-only machine needs the gloo process group set up before the Trainer's own state
    # (Accelerate would otherwise ask for a GPU backend), and that state must be a DeepSpeed one:
    # with ACCELERATE_USE_DEEPSPEED set, PartialState starts it through deepspeed.comm.
    import os

    from accelerate import PartialState

    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    from transformers import AutoModelForCausalLM, TrainingArguments

    _scenario.seed_everything()
    training_args = TrainingArguments(
        output_dir=str(out / "trainer"),
        per_device_train_batch_size=_scenario.MICRO_BATCH,
        max_steps=_scenario.STEPS,
        learning_rate=_scenario.LR,
        warmup_steps=2,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps" if args.scenario in ("zero2", "resume") else "no",
        save_steps=10,
        report_to="none",
        seed=_scenario.SEED,
        dataloader_num_workers=0,
        bf16=args.scenario == "bf16",
        # transformers refuses bf16 without a GPU unless told the CPU is meant.
        use_cpu=args.scenario == "bf16",
        deepspeed=ds_config("zero2" if args.scenario == "resume" else args.scenario),
        accelerator_config={"use_configured_state": True},
    )
    # Built after TrainingArguments: at ZeRO-3 that makes transformers build it inside
    # deepspeed.zero.Init, through the HfDeepSpeedConfig the arguments registered.
    model = AutoModelForCausalLM.from_config(_scenario.tiny_llama_config())
    built = partition_summary(model)
    dataset = _scenario.TokenDataset(_scenario.MICRO_BATCH * 2 * _scenario.STEPS)
    trainer = RecordingTrainer.make(model=model, args=training_args, train_dataset=dataset)
    trainer.train(resume_from_checkpoint=args.resume_from)

    # DeepSpeed keeps buffers (Llama's rotary inv_freq) in fp32 when it casts the parameters.
    buffers = trainer.model_wrapped.module.named_buffers()
    extra: dict[str, Any] = {"built": built, "buffers": {k: str(b.dtype) for k, b in buffers}}
    if args.scenario in ("zero2", "zero3"):
        trainer.save_model(str(out / "final"))
        engine = trainer.model_wrapped
        extra["trained"] = partition_summary(engine.module)
        _dump_full_weights(engine, out / f"weights.rank{_scenario.rank()}.pt")
    _scenario.write_result(out, losses=trainer.losses, **extra)


def _dump_full_weights(engine: Any, path: Path) -> None:
    """Save the engine's full weights (gathered first at ZeRO-3) for the reload comparison."""
    import deepspeed

    module = engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        _scenario.dump_weights(module, path)


if __name__ == "__main__":
    main()
