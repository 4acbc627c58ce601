"""DeepSpeed's ZeRO-3 memory estimators: its formulas, its table, and live models (also when they
are already partitioned)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_zero import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
from ds_zero._memory import model_to_params

B, LAYER = 10**9, 10**8


def test_zero3_formulas_without_offload() -> None:
    cpu, gpu, layer = estimate_zero3_model_states_mem_needs(
        B, LAYER, num_gpus_per_node=8, cpu_offload=False, cpu_offload_params=False
    )
    assert layer == 4 * LAYER
    assert gpu == 4 * LAYER + int(18 * B / 8)
    assert cpu == int(LAYER * 4 * 8 * 1.5)  # zero.Init: one layer per GPU is ever whole
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
        B, LAYER, 8, cpu_offload=False, cpu_offload_params=False, zero_init=False
    )
    assert (cpu, gpu) == (int(B * 4 * 8 * 1.5), 4 * LAYER + int(18 * B / 8))


def test_zero3_formulas_with_offload() -> None:
    # Parameters and optimizer offloaded: the GPU holds the largest layer only.
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(B, LAYER, 4, num_nodes=2)
    assert (cpu, gpu) == (int(B * 18 / 2 * 1.5), 4 * LAYER)
    # Optimizer only: the 16-bit parameter shard (2/N) stays on the GPU.
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(B, LAYER, 4, 2, cpu_offload_params=False)
    assert (cpu, gpu) == (int(B * 16 / 2 * 1.5), 4 * LAYER + int(2 * B / 8))
    # Without zero.Init each GPU process loads the fp32 model once: 4 * gpus_per_node wins.
    cpu, _, _ = estimate_zero3_model_states_mem_needs(B, LAYER, 8, zero_init=False)
    assert cpu == int(B * max(4 * 8, 18) * 1.5)
    cpu, _, _ = estimate_zero3_model_states_mem_needs(B, LAYER, 2, zero_init=False)
    assert cpu == int(B * 18 * 1.5)


def test_zero3_table_matches_deepspeeds_output(capsys: pytest.CaptureFixture[str]) -> None:
    # t5-small (60,506,624 params, 16,449,536 in its shared embedding) on 1 GPU: the numbers
    # DeepSpeed's estimate_zero3_model_states_mem_needs_all_live prints for it.
    text = estimate_zero3_model_states_mem_needs_all_cold(60_506_624, 16_449_536)
    assert capsys.readouterr().out.strip() == text.strip()
    lines = text.splitlines()
    assert lines[1] == "HW: Setup with 1 node, 1 GPU per node."
    assert lines[2] == "SW: Model with 60M total params, 16M largest layer params."
    assert lines[3] == "  per CPU  |  per GPU |   Options"
    cells = [[c.strip() for c in line.split("|")[:2]] for line in lines[4:]]
    assert cells == [
        ["1.52GB", "0.06GB"],
        ["1.52GB", "0.06GB"],
        ["1.35GB", "0.17GB"],
        ["1.35GB", "0.17GB"],
        ["0.09GB", "1.08GB"],
        ["0.34GB", "1.08GB"],
    ]
    assert lines[4].endswith("offload_param=cpu , offload_optimizer=cpu , zero_init=1")
    assert lines[-1].endswith("offload_param=none, offload_optimizer=none, zero_init=0")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 8)  # 800: the largest module
        self.body = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))  # 72 each
        self.head = nn.Linear(8, 100, bias=False)
        self.head.weight = self.embed.weight  # tied: counted once


def test_zero3_live_model_counts_shared_params_once(capsys: pytest.CaptureFixture[str]) -> None:
    model = _Net()
    assert model_to_params(model) == (800 + 2 * 72, 800)
    text = estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=2)
    assert "SW: Model with 0M total params, 0M largest layer params." in text
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(944, 800, 2)
    assert f" {cpu / 2**30:7.2f}GB | {gpu / 2**30:6.2f}GB | offload_param=cpu " in text


def test_zero3_live_model_reads_ds_numel_of_partitioned_params() -> None:
    model = _Net()
    # What stage 3 leaves visible: empty data, the full size in ds_numel.
    for p in model.parameters():
        p.ds_numel = p.numel()
        p.data = torch.empty(0)
    assert model_to_params(model) == (944, 800)
