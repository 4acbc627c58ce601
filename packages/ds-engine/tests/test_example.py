"""The GPT example (tools/examples/gpt) trains on 2 ranks with every shipped config, through its
real entry point ``main()`` (few steps, a narrow model); ``integration/test_examples.py`` runs
each config through ``ds-launch`` exactly as the README says (slow tier)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_testing import run_on_ranks

EXAMPLE = Path(__file__).resolve().parents[3] / "tools" / "examples" / "gpt"
CONFIGS = sorted(p.stem for p in (EXAMPLE / "configs").glob("*.json"))


def _example_body(rank: int, world_size: int, *, config: str, steps: int) -> tuple[float, float]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpt_example", EXAMPLE / "train.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    argv = ["--deepspeed_config", config, "--steps", str(steps), "--dim", "32"]
    losses = example.main(argv)
    return sum(losses[:4]) / 4, sum(losses[-4:]) / 4


def test_every_config_is_valid_json_with_a_stage() -> None:
    assert {"zero0", "zero1", "zero2", "zero3", "offload", "fp16", "bf16"} <= set(CONFIGS)
    for name in CONFIGS:
        config = json.loads((EXAMPLE / "configs" / f"{name}.json").read_text())
        assert "stage" in config["zero_optimization"]


@pytest.mark.parametrize("config", CONFIGS)
def test_example_loss_falls_on_two_ranks(config: str) -> None:
    path = str(EXAMPLE / "configs" / f"{config}.json")
    for first, last in run_on_ranks(_example_body, 2, config=path, steps=25, timeout=300):
        assert last < 0.8 * first
