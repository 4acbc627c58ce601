"""``zero_to_fp32`` output that transformers' ``from_pretrained`` reads: a tiny GPT-2 (built from
its config, tied embeddings) trained 2 steps at ZeRO-3 on 2 gloo ranks through
``deepspeed.initialize``, its checkpoint written by ``convert_zero_checkpoint_to_fp32_state_dict``
as sharded safetensors (``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``)
and as sharded ``.bin`` (``pytorch_model.bin.index.json``), each loaded back with
``from_pretrained`` into weights equal to the engine's fp32 masters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ds_testing import run_on_ranks

transformers = pytest.importorskip("transformers")


def _config():
    return transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, tie_word_embeddings=True
    )


def _train_and_save(rank: int, world_size: int, folder: str) -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_config())
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        ids = torch.randint(0, 64, (2, 8), generator=gen).to(engine.device)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(folder)
    return {n: safe_get_full_fp32_param(p).cpu() for n, p in model.named_parameters()}


@pytest.mark.slow  # ds-engine tests the sharded output and its index by default
def test_from_pretrained_reads_sharded_output(tmp_path: Path) -> None:
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    want = run_on_ranks(_train_and_save, 2, str(tmp_path / "ckpt"), timeout=300)[0]
    for safe, index_name in (
        (True, "model.safetensors.index.json"),
        (False, "pytorch_model.bin.index.json"),
    ):
        out = tmp_path / ("safe" if safe else "bin")
        convert_zero_checkpoint_to_fp32_state_dict(
            tmp_path / "ckpt", out, max_shard_size="8KB", safe_serialization=safe
        )
        index = json.loads((out / index_name).read_text())
        assert len(set(index["weight_map"].values())) > 1  # really sharded
        _config().save_pretrained(out)
        loaded = transformers.GPT2LMHeadModel.from_pretrained(out, torch_dtype=torch.float32)
        params = dict(loaded.named_parameters())
        assert set(params) == set(want)
        for name, value in want.items():
            assert torch.equal(params[name].detach(), value), (safe, name)
        assert loaded.lm_head.weight is loaded.transformer.wte.weight  # re-tied on load
