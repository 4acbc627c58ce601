"""Lightning's ``DeepSpeedStrategy`` (ZeRO-2), 2 ranks under ``torchrun``.

    python -m torch.distributed.run --nproc_per_node 2 run_lightning.py --out DIR

Lightning refuses its DeepSpeed strategy on anything but CUDA devices (checks in
``DeepSpeedStrategy.setup_environment`` and ``setup_distributed``, before DeepSpeed is reached), so
on a CPU machine the strategy is subclassed to skip those two checks and to name its device
``cpu:<local rank>`` (Lightning passes the device index to ``deepspeed.initialize`` as
``args.device_rank``, and a bare ``cpu`` has none); everything else, including
``deepspeed.init_distributed`` and ``deepspeed.initialize``, is Lightning's own code. Real
DeepSpeed needs the same subclass here. Each rank writes ``DIR/result.rank<r>.json``.
"""

from __future__ import annotations

import argparse
from typing import Any

import _scenario
import torch


def cpu_deepspeed_strategy(**kwargs: Any):  # -> DeepSpeedStrategy
    """Lightning's DeepSpeedStrategy minus its CUDA-only guards."""
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        def setup_environment(self) -> None:
            # DeepSpeedStrategy's version only adds "is the accelerator CUDA?".
            DDPStrategy.setup_environment(self)

        def setup_distributed(self) -> None:
            # DeepSpeedStrategy's version, less the check that device indices are GPU ordinals.
            from lightning.fabric.utilities.seed import reset_seed

            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        @property
        def root_device(self) -> torch.device:
            return torch.device("cpu", self.local_rank)

    return CPUDeepSpeedStrategy(**kwargs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import lightning as L
    from transformers import AutoModelForCausalLM

    class TinyLM(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = AutoModelForCausalLM.from_config(_scenario.tiny_llama_config())
            self.losses: list[float] = []

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = self.model(**batch).loss
            self.losses.append(float(loss.detach().item()))
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=_scenario.LR)

    L.seed_everything(_scenario.SEED, workers=True)
    module = TinyLM()
    dataset = _scenario.TokenDataset(_scenario.MICRO_BATCH * 2 * _scenario.STEPS)
    loader = torch.utils.data.DataLoader(dataset, batch_size=_scenario.MICRO_BATCH, shuffle=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=cpu_deepspeed_strategy(stage=2, process_group_backend="gloo"),
        max_steps=_scenario.STEPS,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,
    )
    trainer.fit(module, loader)
    engine = trainer.strategy.deepspeed_engine
    _scenario.write_result(
        args.out,
        losses=module.losses,
        zero_stage=int(engine.zero_optimization_stage()),
        global_steps=int(engine.global_steps),
    )


if __name__ == "__main__":
    main()
