"""Small models for the pipeline tests (shared by every ds-pipe test file).

Test modules put this folder on ``sys.path`` and import it; rank workers load the test module by
path, so the import runs there too.

- :func:`mlp_layers`: an MLP stack of ``LayerSpec`` s with a plain callable in the middle.
- :func:`transformer_layers`: a tiny causal transformer whose embedding and unembedding share one
  weight through ``TiedLayerSpec("embed", ...)`` (first and last stage).
- :func:`build_reference`: the same layers as one plain ``nn.Module`` in one process, every layer
  seeded as ``PipelineModule(..., seed_layers=True, base_seed=...)`` seeds it, so a pipeline and
  its reference start from identical weights whatever the partition.
- :func:`run_micro_batch`: a hand-written one-micro-batch pipeline pass (no engine) over blocking
  p2p, for the module tests; :func:`max_param_error` compares a stage with the reference.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ds_pipe import LayerSpec, PipelineModule, TiedLayerSpec

# MLP stack sizes
MLP_IN, MLP_DIM, MLP_OUT = 8, 16, 4
# transformer sizes
VOCAB, MODEL_DIM, HEADS, SEQ = 32, 16, 2, 8
BASE_SEED = 1234


class MLPBlock(nn.Module):
    """``x + tanh(linear(x))``: a residual block with weights (the unit being partitioned)."""

    def __init__(self, dim: int = MLP_DIM) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


def scale_half(x: torch.Tensor) -> torch.Tensor:
    """A weightless callable layer (module-level so specs pickle)."""
    return x * 0.5


def mlp_layers(num_blocks: int = 6, dim: int = MLP_DIM) -> list[Any]:
    """``Linear(in, dim)``, ``num_blocks`` MLPBlocks with ``scale_half`` after the first, ``Linear(dim, out)``.

    ``num_blocks + 3`` layers in all.
    """
    blocks: list[Any] = [LayerSpec(MLPBlock, dim) for _ in range(num_blocks)]
    return [
        LayerSpec(nn.Linear, MLP_IN, dim),
        blocks[0],
        scale_half,
        *blocks[1:],
        LayerSpec(nn.Linear, dim, MLP_OUT),
    ]


def mlp_batch(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``(rows, MLP_IN)`` and regression targets ``(rows, MLP_OUT)``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, MLP_IN, generator=gen), torch.randn(rows, MLP_OUT, generator=gen)


def mse_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


class TransformerBlock(nn.Module):
    """Pre-LayerNorm causal self-attention and MLP, no dropout (deterministic)."""

    def __init__(self, dim: int = MODEL_DIM, heads: int = HEADS) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attn = scores.masked_fill(mask, float("-inf")).softmax(-1)
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


def unembed(module: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    """The tied unembedding: hidden states times the embedding matrix transposed."""
    return x @ module.weight.t()


def transformer_layers(num_blocks: int = 4) -> list[Any]:
    """Tied embedding, ``num_blocks`` TransformerBlocks, LayerNorm, tied unembedding.

    ``num_blocks + 3`` layers; the first and last share the ``"embed"`` weight.
    """
    return [
        TiedLayerSpec("embed", nn.Embedding, VOCAB, MODEL_DIM),
        *(LayerSpec(TransformerBlock, MODEL_DIM, HEADS) for _ in range(num_blocks)),
        LayerSpec(nn.LayerNorm, MODEL_DIM),
        TiedLayerSpec("embed", nn.Embedding, VOCAB, MODEL_DIM, forward_fn=unembed),
    ]


def lm_batch(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``(rows, SEQ)`` and next-token labels ``(rows, SEQ)``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def seed_everything(seed: int) -> None:
    """What ``seed_layers=True`` does before building layer ``i`` (seed ``base_seed + i``)."""
    random.seed(seed)
    torch.manual_seed(seed)


class Reference(nn.Module):
    """The layers of a pipeline run one after another in one process (the numerics reference).

    Tied specs build one module at their first occurrence; later occurrences reuse it (through
    their ``forward_fn`` when given). Each layer gets the previous layer's output as its one
    argument (a tuple stays one tuple), as DeepSpeed's pipeline calls layers.
    """

    def __init__(self, layers: Sequence[Any], base_seed: int = BASE_SEED) -> None:
        super().__init__()
        self.funcs: list[Callable[..., Any]] = []
        self.tied = nn.ModuleDict()
        self.layers = nn.ModuleDict()
        for idx, layer in enumerate(layers):
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied:
                    seed_everything(base_seed + idx)
                    self.tied[layer.key] = layer.build()
                module = self.tied[layer.key]
                if layer.forward_fn is None:
                    self.funcs.append(module)
                else:
                    fn = layer.forward_fn
                    self.funcs.append(lambda x, _m=module, _f=fn: _f(_m, x))
            elif isinstance(layer, LayerSpec):
                seed_everything(base_seed + idx)
                self.layers[str(idx)] = layer.build()
                self.funcs.append(self.layers[str(idx)])
            elif isinstance(layer, nn.Module):
                self.layers[str(idx)] = layer
                self.funcs.append(layer)
            else:
                self.funcs.append(layer)

    def forward(self, x: Any) -> Any:
        for fn in self.funcs:
            x = fn(x)
        return x


def build_reference(layers: Sequence[Any], base_seed: int = BASE_SEED) -> Reference:
    """:class:`Reference` over ``layers`` (see the module docstring)."""
    return Reference(layers, base_seed)


# --- a hand-written pipeline pass (module tests; the engine has its own schedules) ----------


def boundary_outputs(reference: Any, x: torch.Tensor) -> list[torch.Tensor]:
    """The reference's output after every layer (``outs[i]`` = output of layer ``i``)."""
    outs = []
    with torch.no_grad():
        for fn in reference.funcs:
            x = fn(x)
            outs.append(x)
    return outs


def run_micro_batch(
    module: PipelineModule,
    x: torch.Tensor,
    target: torch.Tensor,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    outs: list[torch.Tensor],
) -> float:
    """Forward and backward of one micro-batch through ``module``'s replica; returns the loss
    (broadcast from the last stage so every stage returns it)."""
    grid = module.grid
    start = module.parts[module.stage_id]
    if module.stage_id == 0:
        inp = x
    else:
        inp = torch.empty_like(outs[start - 1])
        dist.recv(inp, src=grid.prev_stage_rank)
        inp.requires_grad_()
    out = module(inp)
    loss = torch.zeros(())
    if grid.is_last_stage:
        loss = loss_fn(out, target)
        loss.backward()
    else:
        dist.send(out.detach().contiguous(), dst=grid.next_stage_rank)
        grad = torch.empty_like(out)
        dist.recv(grad, src=grid.next_stage_rank)
        out.backward(grad)
    if module.stage_id != 0:
        dist.send(inp.grad.contiguous(), dst=grid.prev_stage_rank)
    module.allreduce_tied_weight_gradients()
    last = grid.stage_to_global(module.num_stages - 1)
    loss = loss.detach().clone()
    dist.broadcast(loss, src=last, group=grid.get_group("pipe"))
    return float(loss)


def reference_name(name: str) -> str:
    """A PipelineModule parameter name as the reference names it."""
    if name.startswith("tied_modules."):
        return "tied." + name[len("tied_modules.") :]
    return "layers." + name


def max_param_error(module: PipelineModule, reference: nn.Module, grads: bool) -> float:
    """Largest absolute difference of this stage's parameters (or grads) from the reference's."""
    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, param in module.named_parameters():
        mine, theirs = param, ref[reference_name(name)]
        if grads:
            assert mine.grad is not None, f"{name} has no gradient"
            mine, theirs = mine.grad, theirs.grad
        worst = max(worst, float((mine - theirs).abs().max()))
    return worst
