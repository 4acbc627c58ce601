"""Ulysses' data split: every rank of a sequence group gets its slice of the same sample.

DeepSpeed's ``UlyssesSPDataLoaderAdapter`` (``deepspeed.runtime.sequence_parallel.ulysses_sp``)
wraps any loader. Each rank of the sequence group draws one batch from its own loader; the group
exchanges them, and every batch is then processed by the whole group in turn, rank ``r`` taking
the ``r``-th slice of its sequence. ``P`` steps of the adapter consume what ``P`` steps of the
wrapped loaders read (one batch per rank), so an epoch covers the data once.

Before slicing, ``labels`` become ``shift_labels`` (next-token labels over the whole sequence,
``-100`` after the last token): the last token of a slice predicts the first of the next slice,
which a per-slice shift would lose.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

import ds_comm

__all__ = ["UlyssesSPDataLoaderAdapter", "shard_sequence"]

_IGNORE = -100


def shard_sequence(batch: Mapping[str, Any], sp_rank: int, sp_world_size: int) -> dict[str, Any]:
    """Rank ``sp_rank``'s slice of a ``[batch, seq, ...]`` batch: ``labels`` become
    ``shift_labels`` over the whole sequence first; non-tensors are kept as they are.

    Raises:
        ValueError: the sequence length does not divide by ``sp_world_size``.
    """
    batch = dict(batch)
    seq = batch["input_ids"].shape[1]
    if seq % sp_world_size:
        raise ValueError(
            f"UlyssesSPDataLoaderAdapter: the batch's sequence length {seq} is not divisible by "
            f"the sequence parallel size {sp_world_size}; pad sequences to a multiple of it"
        )
    if "labels" in batch:
        labels = batch.pop("labels")
        batch["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=_IGNORE)[:, 1:]
    chunk = seq // sp_world_size
    return {
        k: v[:, sp_rank * chunk : (sp_rank + 1) * chunk].contiguous() if torch.is_tensor(v) else v
        for k, v in batch.items()
    }


class UlyssesSPDataLoaderAdapter:
    """DeepSpeed's ``UlyssesSPDataLoaderAdapter``: a loader of sequence slices.

    Args:
        dl: the loader to wrap; its batches are dicts of ``[batch, seq, ...]`` tensors with
            ``input_ids`` and ``position_ids`` (the positions the slices keep; DeepSpeed
            requires them), and usually ``labels``.
        sp_rank: this rank's index in the sequence-parallel group.
        sp_group: the sequence-parallel group.
        sp_world_size: its size.
        device: where the exchange runs (the accelerator's device of this rank); the slices
            are kept in host memory, as DeepSpeed does (a long sequence's batches are large).

    Example:
        >>> loader = UlyssesSPDataLoaderAdapter(
        ...     dl, sp_rank=groups._get_sequence_parallel_rank(),
        ...     sp_group=groups._get_sequence_parallel_group(),
        ...     sp_world_size=groups._get_sequence_parallel_world_size(), device=engine.device)
        >>> for batch in loader:  # batch["input_ids"]: [b, seq / sp]; batch["shift_labels"]
        ...     ...
    """

    def __init__(
        self, dl: Any, sp_rank: int, sp_group: Any, sp_world_size: int, device: Any
    ) -> None:
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = device
        self.iter = iter(dl)
        self.micro_batches: deque[dict[str, Any]] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def refill(self) -> None:
        """Draw one batch here, exchange it over the group and queue this rank's slice of
        each member's batch (in group-rank order). At the end of the wrapped loader, restart
        it and raise ``StopIteration`` (so the next epoch can begin)."""
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)
            raise
        _check_batch(batch)
        for member in self._exchange(batch):
            shard = shard_sequence(member, self.sp_rank, self.sp_world_size)
            host = {k: v.cpu() if torch.is_tensor(v) else v for k, v in shard.items()}
            self.micro_batches.append(host)

    def _exchange(self, batch: Mapping[str, Any]) -> list[dict[str, Any]]:
        """Every group member's batch (tensors padded to the longest sequence for the
        all-gather, then cut back; non-tensors through ``all_gather_object``)."""
        size = self.sp_world_size
        shapes: list[Any] = [None] * size
        mine = {k: (tuple(v.shape), v.dtype) for k, v in batch.items() if torch.is_tensor(v)}
        others = {k: v for k, v in batch.items() if not torch.is_tensor(v)}
        ds_comm.all_gather_object(shapes, (mine, others), group=self.sp_group)
        members: list[dict[str, Any]] = [dict(s[1]) for s in shapes]
        for key, tensor in batch.items():
            if not torch.is_tensor(tensor):
                continue
            peers = [s[0][key][0] for s in shapes]
            gathered = _gather_padded(tensor.to(self.device), peers, self.sp_group)
            for member, value in zip(members, gathered):
                member[key] = value
        return members


def _check_batch(batch: Any) -> None:
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise ValueError(
            "UlyssesSPDataLoaderAdapter: each batch must be a dict with 'input_ids' "
            f"([batch, seq]); got {type(batch).__name__}"
        )
    if "position_ids" not in batch:
        raise ValueError(
            "UlyssesSPDataLoaderAdapter: each batch needs 'position_ids' so that every token "
            "keeps its global position after the sequence is split (for unpacked sequences: "
            "torch.arange(seq_len) per sample); add them in your collate function"
        )
    seq = batch["input_ids"].shape[1]
    for key, value in batch.items():
        if torch.is_tensor(value) and (value.dim() < 2 or value.shape[1] != seq):
            raise ValueError(
                f"UlyssesSPDataLoaderAdapter: {key} has shape {tuple(value.shape)}; every tensor "
                f"must be [batch, seq, ...] with input_ids' sequence length {seq}"
            )


def _gather_padded(tensor: Tensor, shapes: list[tuple[int, ...]], group: Any) -> list[Tensor]:
    """All-gather tensors that may differ in their first two dims (batch, sequence)."""
    rows = max(s[0] for s in shapes)
    cols = max(s[1] for s in shapes)
    padded = tensor.new_zeros((rows, cols, *tensor.shape[2:]))
    padded[: tensor.shape[0], : tensor.shape[1]] = tensor
    out = [torch.empty_like(padded) for _ in shapes]
    ds_comm.all_gather(out, padded, group=group)
    return [t[: s[0], : s[1]] for t, s in zip(out, shapes)]
