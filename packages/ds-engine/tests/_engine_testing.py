"""Shared test helpers: a small regression model, deterministic data, a reference loop.

Test modules put this folder on ``sys.path`` and import it; rank workers load the test module by
path, so the import runs there too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

IN, HIDDEN, OUT = 8, 16, 4


def make_mlp(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Dropout(dropout), nn.Linear(HIDDEN, OUT)
    )


def make_dataset(rows: int, seed: int = 1) -> torch.utils.data.TensorDataset:
    """A learnable regression set: targets are a fixed linear map of the inputs plus noise."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, IN, generator=gen)
    w = torch.randn(IN, OUT, generator=gen)
    return torch.utils.data.TensorDataset(x, x @ w + 0.01 * torch.randn(rows, OUT, generator=gen))


def loss_of(model: Callable[..., torch.Tensor], batch: list[torch.Tensor]) -> torch.Tensor:
    x, y = batch
    out = model(x.to(next(iter(_params(model))).dtype))
    return nn.functional.mse_loss(out.float(), y)


def _params(model: Callable[..., torch.Tensor]):
    module = getattr(model, "module", model)
    return module.parameters()


def config(**overrides: object) -> dict:
    """A small DeepSpeed config: Adam at lr 1e-2, no clipping, quiet logs."""
    base: dict = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.0}},
    }
    base.update(overrides)
    return base


def reference_adam(
    model: nn.Module, batches: list[list[torch.Tensor]], *, lr: float = 1e-2, clip: float = 0.0
) -> dict[str, torch.Tensor]:
    """Single-process Adam on each full batch (the data-parallel ranks' micro-batches joined)."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    for batch in batches:
        optimizer.zero_grad()
        loss_of(model, batch).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def max_error(model: nn.Module, reference: dict[str, torch.Tensor]) -> float:
    """Largest elementwise difference relative to each reference tensor's largest element."""
    worst = 0.0
    for name, p in model.named_parameters():
        a, b = p.detach().float(), reference[name].float()
        worst = max(worst, (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12))
    return worst
