"""Accelerate on DeepSpeed: a plain training loop, 2 ranks.

    # the plugin given in code (ZeRO-2), under torchrun:
    python -m torch.distributed.run --nproc_per_node 2 run_accelerate.py --mode plugin --out DIR
    # the plugin read from an ``accelerate launch`` config file (ZeRO-2, 2 accumulation steps):
    accelerate launch --config_file accelerate_zero2.yaml run_accelerate.py --mode launch --out DIR
    # the same at ZeRO-3, the model built inside zero.Init (zero3_init_flag):
    accelerate launch --config_file accelerate_zero3.yaml run_accelerate.py --mode launch --out DIR

The optimizer is the client's own ``torch.optim.AdamW`` (no ``optimizer`` section in the config),
the other half of how DeepSpeed meets its users. In plugin mode the run also goes through
Accelerate's checkpoint flow (``save_state`` after 10 steps, ``load_state`` at the end and the
last 10 steps replayed: ``replayed``). Every mode ends with Accelerate's documented save
(``get_state_dict`` + ``save_pretrained`` to ``DIR/final``). Each rank writes ``DIR/result.rank<r>.json`` with the loss
of every micro-batch.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import _scenario
import torch


def build_accelerator(mode: str):  # -> accelerate.Accelerator
    """An Accelerator on DeepSpeed whose process group is gloo (the machine has no GPU)."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    handlers = [InitProcessGroupKwargs(backend="gloo")]
    if mode == "launch":
        # `accelerate launch` passed the DeepSpeed settings of its config file in the environment.
        return Accelerator(kwargs_handlers=handlers)
    plugin = DeepSpeedPlugin(zero_stage=2, gradient_accumulation_steps=1, gradient_clipping=1.0)
    return Accelerator(deepspeed_plugin=plugin, kwargs_handlers=handlers)


def train(accelerator, model, optimizer, batches: list) -> list[float]:
    """One loss per micro-batch, stepping through Accelerate as its docs show."""
    losses = []
    for batch in batches:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(loss.detach().item()))
    return losses


def save_pretrained(accelerator, model, out: Path) -> None:
    """The save Accelerate documents for DeepSpeed: the full state dict, then save_pretrained.

    Each rank also keeps what it got from ``get_state_dict`` for the reload comparison.
    """
    state = accelerator.get_state_dict(model)
    if state is not None:
        # Copied first: save_pretrained may consume the dict it is given on the main process.
        full = {name: tensor.detach().float().cpu().clone() for name, tensor in state.items()}
        torch.save(full, out / f"weights.rank{_scenario.rank()}.pt")
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(
        str(out / "final"), state_dict=state, is_main_process=accelerator.is_main_process
    )
    accelerator.wait_for_everyone()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True, choices=["plugin", "launch"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)

    accelerator = build_accelerator(args.mode)
    _scenario.seed_everything()
    from transformers import AutoModelForCausalLM

    # Built after the Accelerator: with zero3_init_flag, inside deepspeed.zero.Init.
    model = AutoModelForCausalLM.from_config(_scenario.tiny_llama_config())
    built = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=_scenario.LR)
    dataset = _scenario.TokenDataset(_scenario.MICRO_BATCH * 2 * _scenario.STEPS)
    loader = torch.utils.data.DataLoader(dataset, batch_size=_scenario.MICRO_BATCH, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    half = _scenario.STEPS // 2
    model.train()
    losses: list[float] = []
    seen = []
    for batch in loader:
        losses += train(accelerator, model, optimizer, [batch])
        seen.append(batch)
        if args.mode == "plugin" and len(losses) == half:
            # Accelerate's own checkpoint flow: save_state mid-run, load it back at the end and
            # replay the second half, which must repeat itself.
            accelerator.save_state(str(out / "state"))
        if len(losses) == _scenario.STEPS:
            break
    extra = {}
    if args.mode == "plugin":
        accelerator.load_state(str(out / "state"))
        extra["replayed"] = train(accelerator, model, optimizer, seen[half:])
    save_pretrained(accelerator, model, out)
    engine = accelerator.deepspeed_engine_wrapped.engine
    _scenario.write_result(
        args.out,
        losses=losses,
        **extra,
        built_local_numel=built,
        zero_stage=int(engine.zero_optimization_stage()),
        accumulation=int(engine.gradient_accumulation_steps()),
        global_steps=int(engine.global_steps),
    )
    accelerator.end_training()


if __name__ == "__main__":
    main()
