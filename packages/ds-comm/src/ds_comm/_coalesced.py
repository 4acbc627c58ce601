"""Coalesced collectives: many tensors moved in one collective per dtype and device.

``all_reduce_coalesced`` and ``all_gather_coalesced`` (DeepSpeed's ``deepspeed.comm`` names)
flatten their tensors into one buffer per (dtype, device), in the order given, and issue one
:func:`~ds_comm.all_reduce` / :func:`~ds_comm.all_gather_into_tensor` per buffer, so each is
tracked, logged and covered by hang forensics like any other call, with the same algorithm
choice and fallbacks. Results are copied back into the caller's tensors when the call completes
(at ``wait()`` for async calls). ``inference_all_reduce`` is DeepSpeed's name for an in-place
all-reduce on the inference path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ds_comm import _algorithms as alg
from ds_comm._collectives import _member, all_gather_into_tensor, all_reduce
from ds_comm._instrument import check_devices
from ds_comm.api import ReduceOp

__all__ = ["all_gather_coalesced", "all_reduce_coalesced", "inference_all_reduce"]


def _buckets(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by (dtype, device), groups in order of first appearance."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    return list(groups.values())


def _finish(pending: alg.Pending, async_op: bool) -> alg.Pending | None:
    if async_op:
        return pending
    pending.wait()
    return None


def all_reduce_coalesced(
    tensors: list[torch.Tensor],
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
) -> alg.Pending | None:
    """All-reduce every tensor of ``tensors`` in place with one collective per dtype and device.

    Every rank must pass the same shapes and dtypes in the same order.

    Example:
        >>> ds_comm.all_reduce_coalesced([grad_a, grad_b, grad_c])  # one all_reduce if same dtype
    """
    if not tensors or _member(group, tensors[0]) is None:
        return _finish(alg.Pending(), async_op)
    check_devices("all_reduce_coalesced", group, tensors)  # before any part is issued
    works, copies = [], []
    for indices in _buckets(tensors):
        flat = torch.cat([tensors[i].reshape(-1) for i in indices])
        works.append(all_reduce(flat, op=op, group=group, async_op=True))
        copies.append((flat, indices))

    def copy_back() -> None:
        for flat, indices in copies:
            parts = flat.split([tensors[i].numel() for i in indices])
            for i, part in zip(indices, parts):
                tensors[i].copy_(part.view(tensors[i].shape))

    return _finish(alg.Pending(works, copy_back), async_op)


def all_gather_coalesced(
    output_tensors: list[torch.Tensor],
    input_tensors: list[torch.Tensor],
    group: Any = None,
    async_op: bool = False,
) -> alg.Pending | None:
    """All-gather each ``input_tensors[k]`` into ``output_tensors[k]`` (group size x its elements).

    ``output_tensors[k]`` holds every rank's ``input_tensors[k]`` concatenated in group-rank
    order, as :func:`~ds_comm.all_gather_into_tensor` would; one collective per dtype and device
    moves them all.
    """
    if len(output_tensors) != len(input_tensors):
        raise ValueError(
            f"all_gather_coalesced: {len(output_tensors)} outputs for {len(input_tensors)} inputs"
        )
    if not input_tensors or (member := _member(group, input_tensors[0])) is None:
        return _finish(alg.Pending(), async_op)
    n = len(member.ranks)
    for k, (out, inp) in enumerate(zip(output_tensors, input_tensors)):
        if out.numel() != n * inp.numel() or out.dtype != inp.dtype:
            raise ValueError(
                f"all_gather_coalesced: output {k} must be {inp.dtype} with {n} x {inp.numel()} "
                f"elements, got {out.dtype} {tuple(out.shape)}"
            )
    check_devices("all_gather_coalesced", group, [*output_tensors, *input_tensors])
    works, copies = [], []
    for indices in _buckets(input_tensors):
        flat_in = torch.cat([input_tensors[i].reshape(-1) for i in indices])
        flat_out = flat_in.new_empty(n * flat_in.numel())
        works.append(all_gather_into_tensor(flat_out, flat_in, group=group, async_op=True))
        copies.append((flat_out.view(n, flat_in.numel()), indices))

    def copy_out() -> None:
        for by_rank, indices in copies:
            offset = 0
            for i in indices:
                size = input_tensors[i].numel()
                block = by_rank[:, offset : offset + size]
                output_tensors[i].copy_(block.reshape(output_tensors[i].shape))
                offset += size

    return _finish(alg.Pending(works, copy_out), async_op)


def inference_all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False
) -> Any:
    """All-reduce ``tensor`` in place (DeepSpeed's inference-path name for :func:`all_reduce`)."""
    return all_reduce(tensor, op=op, group=group, async_op=async_op)
