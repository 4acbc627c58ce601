"""Rooted and list-form collectives: ``gather``, ``scatter``, ``all_to_all``, ``monitored_barrier``.

Same path as the ops in ``_collectives.py``: each call is tracked (sequence number, fingerprint,
hang forensics, comms logger) and picks its algorithm per [Note: choosing an algorithm] there.
Message sizes follow nccl-tests: gather and scatter count the whole gathered/scattered buffer
(group size x one rank's block), all_to_all the bytes this rank sends. ``src``/``dst`` are
global ranks, as in torch.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ds_comm import _algorithms as alg
from ds_comm._collectives import _contiguous_outputs, _Member, _member, _run, _then
from ds_comm._instrument import TrackedWork, tracked

__all__ = ["all_to_all", "gather", "monitored_barrier", "scatter"]


def _root_index(op: str, root: int, member: _Member) -> int:
    if root not in member.ranks:
        raise ValueError(
            f"{op}: rank {root} is not in the group (global ranks {list(member.ranks)}); "
            "src/dst are global ranks, as in torch.distributed"
        )
    return member.ranks.index(root)


def _check_root_list(
    op: str, name: str, tensors: list[torch.Tensor] | None, member: _Member, is_root: bool
) -> list[torch.Tensor] | None:
    """The root's list (one tensor per group rank); other ranks must pass None or nothing."""
    n, rank = len(member.ranks), member.ranks[member.me]
    if is_root:
        if tensors is None or len(tensors) != n:
            got = "None" if tensors is None else f"{len(tensors)} tensors"
            raise ValueError(f"{op}: on the root (rank {rank}) {name} needs {n} tensors, got {got}")
        return list(tensors)
    if tensors:
        raise ValueError(
            f"{op}: rank {rank} is not the root but passed a {name} of {len(tensors)} tensors; "
            "pass None on every rank but the root"
        )
    return None


def gather(
    tensor: torch.Tensor,
    gather_list: list[torch.Tensor] | None = None,
    dst: int = 0,
    group: Any = None,
    async_op: bool = False,
) -> TrackedWork | None:
    """Collect every rank's ``tensor`` into ``gather_list`` on global rank ``dst`` (group order).

    Example:
        >>> outs = [torch.empty(4) for _ in range(world)] if rank == 0 else None
        >>> ds_comm.gather(torch.full((4,), float(rank)), outs, dst=0)
    """
    if (member := _member(group, tensor)) is None:
        return None
    is_dst = _root_index("gather", dst, member) == member.me
    outputs = _check_root_list("gather", "gather_list", gather_list, member, is_dst)

    def issue(algo: str) -> Any:
        return dist.gather(tensor, outputs, dst=dst, group=group, async_op=True)

    tensors = [tensor, *(outputs or [])]
    n = len(member.ranks)
    return _run("gather", group, member, tensors, tensor.nbytes * n, async_op, issue)


def scatter(
    tensor: torch.Tensor,
    scatter_list: list[torch.Tensor] | None = None,
    src: int = 0,
    group: Any = None,
    async_op: bool = False,
) -> TrackedWork | None:
    """Send ``scatter_list[i]`` from global rank ``src`` to group rank i's ``tensor``.

    Example:
        >>> parts = list(torch.arange(8.0).chunk(world)) if rank == 0 else None
        >>> ds_comm.scatter(mine, parts, src=0)
    """
    if (member := _member(group, tensor)) is None:
        return None
    is_src = _root_index("scatter", src, member) == member.me
    inputs = _check_root_list("scatter", "scatter_list", scatter_list, member, is_src)

    def issue(algo: str) -> Any:
        return dist.scatter(tensor, inputs, src=src, group=group, async_op=True)

    tensors = [tensor, *(inputs or [])]
    n = len(member.ranks)
    return _run("scatter", group, member, tensors, tensor.nbytes * n, async_op, issue)


def all_to_all(
    output_tensor_list: list[torch.Tensor],
    input_tensor_list: list[torch.Tensor],
    group: Any = None,
    async_op: bool = False,
) -> TrackedWork | None:
    """Send ``input_tensor_list[i]`` to group rank i; ``output_tensor_list[i]`` receives from it.

    Blocks may differ in size (``output_tensor_list[i]`` matches rank i's block for this rank).
    """
    if not input_tensor_list:
        raise ValueError("all_to_all: input_tensor_list is empty; pass one tensor per group rank")
    if (member := _member(group, input_tensor_list[0])) is None:
        return None
    n = len(member.ranks)
    for name, tensors in (("output", output_tensor_list), ("input", input_tensor_list)):
        if len(tensors) != n:
            raise ValueError(
                f"all_to_all: {name}_tensor_list has {len(tensors)} tensors, group has {n} ranks"
            )

    def issue(algo: str) -> Any:
        if algo == "native":
            return dist.all_to_all(
                output_tensor_list, input_tensor_list, group=group, async_op=True
            )
        staged, copy_back = _contiguous_outputs(output_tensor_list)
        sources = [t.contiguous() for t in input_tensor_list]
        pending = alg.all_to_all_direct(staged, sources, group, ranks=member.ranks, me=member.me)
        return _then(pending, copy_back)

    tensors = [*output_tensor_list, *input_tensor_list]
    shape = input_tensor_list[0].shape
    uniform = all(t.shape == shape and t.is_contiguous() for t in tensors)
    # gloo's own needs equal, contiguous blocks: otherwise go point-to-point
    preferred = "direct" if member.backend == "gloo" and not uniform else "native"
    msg_bytes = sum(t.nbytes for t in input_tensor_list)
    return _run(
        "all_to_all", group, member, tensors, msg_bytes, async_op, issue, preferred=preferred
    )


def monitored_barrier(
    group: Any = None, timeout: timedelta | None = None, wait_all_ranks: bool = False
) -> None:
    """A barrier that names the ranks that failed to reach it within ``timeout`` (gloo groups).

    Rank 0 waits for every other rank and raises naming the first missing one (all of them with
    ``wait_all_ranks``). As in torch, it needs a gloo group; on NCCL use :func:`barrier`, whose
    hangs ds-comm's watchdog explains.
    """
    if _member(group) is None:
        return None
    tracked(
        "monitored_barrier",
        group,
        [],
        msg_bytes=0,
        algo="native",
        async_op=False,
        run=lambda: dist.monitored_barrier(
            group=group, timeout=timeout, wait_all_ranks=wait_all_ranks
        ),
    )
    return None
