"""ZeRO-3 gathers a partitioned parameter that a forward reads outside its owning module's own
forward (DeepSpeed's automatic external parameters): a GPT whose root forward multiplies by the
embedding's weight (a tied head, after the embedding's forward released it), a container that reads its child's
weight, and ``nn.MultiheadAttention`` inside ``nn.TransformerEncoderLayer`` reading
``out_proj.weight`` without calling ``out_proj`` (in training and in evaluation). Losses and
weights equal stage 0's step by step, on one and two ranks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_testing import run_on_ranks

sys.path.insert(0, str(Path(__file__).parent))
from _engine_testing import config

VOCAB, DIM, SEQ, STEPS = 32, 16, 9, 4
RELATIVE_TOLERANCE = 1e-5  # fp32; stage 3 reduces in another order than stage 0


class TiedGPT(nn.Module):
    """Embedding, one pre-norm transformer block and a head tied to the embedding, applied in
    the root's forward (as ``tools/bench/gpu.py``'s GPT)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.position = nn.Parameter(0.02 * torch.randn(SEQ - 1, DIM))
        self.block = nn.TransformerEncoderLayer(
            DIM, 2, 2 * DIM, dropout=0.0, batch_first=True, norm_first=True
        )
        self.norm = nn.LayerNorm(DIM)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1]) + self.position
        x = self.block(x)
        logits = F.linear(self.norm(x), self.embed.weight)
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


class ContainerReadsChild(nn.Module):
    """A module with no parameters of its own whose forward reads a child's weight directly,
    besides calling the child."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.embed(tokens[:, :-1]))
        logits = x @ self.embed.weight.t() + self.proj.bias.sum()
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


MODELS = {"tied_gpt": TiedGPT, "container": ContainerReadsChild}


def _config(stage: int) -> dict:
    zero: dict = {"stage": stage}
    if stage == 3:  # nothing stays whole: every parameter is gathered around its use and
        # released after it (a large model's reuse distance exceeds the default's too)
        zero["stage3_param_persistence_threshold"] = 0
        zero["stage3_max_reuse_distance"] = 0
    return config(train_micro_batch_size_per_gpu=2, zero_optimization=zero, seed=3)


def _batches(rank: int, steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, VOCAB, (2, SEQ), generator=gen) for _ in range(steps)]


def _whole(module: nn.Module) -> dict[str, torch.Tensor]:
    import ds_engine

    with ds_engine.zero.GatheredParameters(list(module.parameters())):
        return {n: p.detach().clone() for n, p in module.named_parameters()}


def _train(stage: int, name: str, rank: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    import ds_engine

    torch.manual_seed(0)
    engine, _, _, _ = ds_engine.initialize(model=MODELS[name](), config=_config(stage))
    losses, weights = [], []
    for tokens in _batches(rank, STEPS):
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        weights.append(_whole(engine.module))
    return losses, weights


def _parity_body(rank: int, world_size: int, *, name: str) -> bool:
    reference, reference_weights = _train(0, name, rank)
    losses, weights = _train(3, name, rank)
    for step, (a, b) in enumerate(zip(losses, reference)):
        assert abs(a - b) <= RELATIVE_TOLERANCE * abs(b), (step, losses, reference)
    for step, (mine, ref) in enumerate(zip(weights, reference_weights)):
        for key in ref:
            torch.testing.assert_close(
                mine[key], ref[key], rtol=1e-5, atol=1e-6, msg=f"step {step}: {key}"
            )
    return True


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_parameters_read_outside_their_module_train_as_stage_0(name: str, world_size: int) -> None:
    assert run_on_ranks(_parity_body, world_size, name=name) == [True] * world_size


def _eval_body(rank: int, world_size: int) -> bool:
    import ds_engine

    x = torch.randn(2, SEQ, DIM, generator=torch.Generator().manual_seed(rank))
    outputs = []
    for stage in (0, 3):
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(DIM, 2, 2 * DIM, dropout=0.0, batch_first=True)
        engine, _, _, _ = ds_engine.initialize(model=layer, config=_config(stage))
        engine.eval()
        with torch.no_grad():
            outputs.append([engine(x), engine(x)])  # twice: the second follows the trace
    for a, b in zip(outputs[1], outputs[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    return True


@pytest.mark.parametrize("world_size", [1, 2])
def test_encoder_layer_in_evaluation_matches_stage_0(world_size: int) -> None:
    assert run_on_ranks(_eval_body, world_size) == [True] * world_size
