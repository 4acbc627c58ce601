"""Shared test helpers: a tiny GPT, deterministic batches, and the single-process reference.

Test modules put this folder on ``sys.path`` and import it; rank workers load the test module by
path, so the import runs there too.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ = 64, 8


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        # No projection biases: the key bias has an exactly-zero gradient (softmax ignores a
        # per-query constant), whose rounding noise Adam would blow up to +-lr updates.
        self.attn = nn.MultiheadAttention(dim, heads, bias=False, batch_first=True)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyGPT(nn.Module):
    """Token + position embeddings, pre-norm blocks, a head tied to the token embedding."""

    def __init__(self, dim: int = 32, layers: int = 2, heads: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(SEQ, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of ``tokens`` (batch, SEQ + 1)."""
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = self.tok(inputs) + self.pos(torch.arange(inputs.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_model(dtype: torch.dtype, seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT().to(dtype)


def global_batches(steps: int, rows: int, seed: int = 1) -> list[torch.Tensor]:
    """One (rows, SEQ + 1) token batch per step, identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (rows, SEQ + 1), generator=gen) for _ in range(steps)]


def micro_batches(
    batch: torch.Tensor, rank: int, world_size: int, accum: int
) -> Iterator[torch.Tensor]:
    """This rank's ``accum`` micro-batches of a global batch (equal sizes: the mean of their
    means is the global mean)."""
    chunks = batch.chunk(world_size * accum)
    for j in range(accum):
        yield chunks[j * world_size + rank]


@dataclass(frozen=True)
class Recipe:
    """How the reference trains: optimizer factory and clipping."""

    make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
    clip: float = 0.0


def adam(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8)


def cpu_adam(params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """ds-optim's CPUAdam with :func:`adam`'s hyper-parameters (no weight decay: same math)."""
    import ds_optim

    return ds_optim.CPUAdam(params, lr=1e-2, betas=(0.9, 0.99), eps=1e-8)


def reference_train(
    model: nn.Module, batches: list[torch.Tensor], recipe: Recipe
) -> dict[str, torch.Tensor]:
    """Single-process training on each full batch: fp32 masters stepped, cast into the model."""
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float().clone() for p in params]
    optimizer = recipe.make_optimizer(masters)
    for batch in batches:
        model(batch).backward()
        for m, p in zip(masters, params):
            m.grad = p.grad.float()
            p.grad = None
        if recipe.clip > 0:
            torch.nn.utils.clip_grad_norm_(masters, recipe.clip)
        optimizer.step()
        with torch.no_grad():
            for m, p in zip(masters, params):
                p.copy_(m)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def parameter_error(model: nn.Module, reference: dict[str, torch.Tensor]) -> float:
    """The worst parameter tensor's distance from the reference, relative to the reference.

    fp32 models: ``max|a - b| / max|b|`` (elementwise agreement). Low precision models:
    ``||a - b|| / ||b||``. Adam turns each element's gradient into an update of about +-lr
    whatever its size, so the few elements whose gradient is below bf16's rounding of the
    micro-batch sums take different signs; the norm measures the tensor, not those elements.
    """
    worst = 0.0
    for name, p in model.named_parameters():
        a, b = p.detach().float(), reference[name].float()
        if p.dtype == torch.float32:
            err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-12)
        else:
            err = (a - b).norm().item() / max(b.norm().item(), 1e-12)
        worst = max(worst, err) if math.isfinite(err) else math.inf
    return worst


def drop_cached_pages(path: Path, tries: int = 20) -> None:
    """Evict ``path``'s pages from the page cache (fsynced first, so they are clean).

    ``POSIX_FADV_DONTNEED`` is advice: a page still being read in, or not yet on the LRU
    lists, survives it. So the advice is repeated until ``mincore`` (an oracle apart from the
    ``RWF_NOWAIT`` probes the tests check) finds no page resident, ``tries`` times at most.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        for _ in range(tries):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            if not _resident_pages(fd):
                return
            time.sleep(0.01)
    finally:
        os.close(fd)


@functools.cache
def _libc() -> ctypes.CDLL:
    """libc with the signatures of ``mmap``, ``munmap`` and ``mincore``."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return libc


def _resident_pages(fd: int) -> int:
    """How many of the file's pages ``mincore`` reports in memory (0 where it cannot tell)."""
    size = os.fstat(fd).st_size
    if not size:
        return 0
    libc = _libc()
    address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        return 0
    try:
        pages = ctypes.create_string_buffer((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
        if libc.mincore(address, size, pages) != 0:
            return 0
        return sum(byte & 1 for byte in pages.raw)
    finally:
        libc.munmap(address, size)
