"""What every client scenario shares: a tiny model, synthetic data, seeds, result files.

The scenario scripts (``run_*.py``) import this module by name: a script's own folder is first on
``sys.path``, so it works under ``torchrun`` and ``accelerate launch`` alike, in the ds venv and in
a venv with real DeepSpeed (``make_reference.py``). Nothing here imports ``deepspeed``: the
scenario scripts import it, exactly as client code would.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import torch

SEED = 1234
VOCAB = 128
SEQ_LEN = 16
MICRO_BATCH = 4
STEPS = 20
LR = 1e-2


def seed_everything(seed: int = SEED) -> None:
    """Seed Python, NumPy (when present) and torch, on every rank alike."""
    random.seed(seed)
    try:
        import numpy

        numpy.random.seed(seed)
    except ImportError:
        pass
    torch.manual_seed(seed)


def rank() -> int:
    """This process's global rank, from the launcher's environment."""
    return int(os.environ.get("RANK", "0"))


def tiny_llama_config() -> Any:
    """A 2-layer Llama small enough to train 20 steps on 2 CPU ranks in seconds.

    Llama (not GPT-2) on purpose: its rotary ``inv_freq`` buffer shows whether mixed precision
    keeps buffers in fp32, as DeepSpeed does.
    """
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def token_rows(count: int, seed: int = SEED) -> torch.Tensor:
    """``count`` learnable sequences: each counts up from a random start by a random stride.

    The next token follows from the two before it, so a tiny model's loss falls quickly from
    ``log(VOCAB)``, and every run (DeepSpeed or ds) sees the same rows.
    """
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (count, 1), generator=generator)
    strides = torch.randint(1, 8, (count, 1), generator=generator)
    positions = torch.arange(SEQ_LEN).unsqueeze(0)
    return (starts + strides * positions) % VOCAB


class TokenDataset(torch.utils.data.Dataset):
    """Causal-LM rows as the Hugging Face Trainer expects them (``input_ids`` and ``labels``)."""

    def __init__(self, count: int, seed: int = SEED) -> None:
        self.rows = token_rows(count, seed)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.rows[index]
        return {"input_ids": row, "labels": row.clone()}


def write_result(out_dir: str | Path, **fields: Any) -> None:
    """Write this rank's result (losses and anything else) as ``result.rank<r>.json``."""
    path = Path(out_dir) / f"result.rank{rank()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fields, indent=1))


def dump_weights(module: torch.nn.Module, path: str | Path) -> None:
    """Save a full (already gathered) fp32 copy of ``module``'s state dict for later comparison."""
    state = {
        name: tensor.detach().float().cpu().clone() for name, tensor in module.state_dict().items()
    }
    torch.save(state, path)
