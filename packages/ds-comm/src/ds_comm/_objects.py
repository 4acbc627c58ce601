"""Object collectives: ``all_gather_object``, ``broadcast_object_list``, ``gather_object``,
``scatter_object_list`` (``torch.distributed``'s signatures and semantics).

Objects are pickled into byte tensors and moved by ds-comm's own tensor collectives (a size
exchange, then the padded payload), so every step is tracked, logged and covered by hang
forensics under the tensor op that moved it, with that op's algorithm choice and fallbacks.
The bytes travel on the device the group's backend needs: the accelerator's current device for
an NCCL-only group, the host otherwise (``broadcast_object_list`` takes an explicit ``device``,
as in torch). As with torch, unpickling runs code chosen by the sender: use these only between
ranks of one trusted job.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from ds_comm._collectives import _Member, _member, all_gather_into_tensor, broadcast
from ds_comm._device_guard import group_device
from ds_comm._gather_scatter import _root_index, gather, scatter

__all__ = ["all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"]


def _to_bytes(obj: Any, device: torch.device) -> torch.Tensor:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _from_bytes(t: torch.Tensor) -> Any:
    return pickle.loads(bytes(t.detach().to("cpu").clone().untyped_storage()))


def _padded(payload: torch.Tensor, length: int) -> torch.Tensor:
    out = payload.new_zeros(length)
    out[: payload.numel()] = payload
    return out


def _all_sizes(payload: torch.Tensor, member: _Member, group: Any) -> tuple[torch.Tensor, int]:
    """Every rank's payload size (on the host) and the largest."""
    n = len(member.ranks)
    sizes = torch.zeros(n, dtype=torch.int64, device=payload.device)
    mine = torch.tensor([payload.numel()], dtype=torch.int64, device=payload.device)
    all_gather_into_tensor(sizes, mine, group=group)
    sizes = sizes.cpu()
    return sizes, int(sizes.max())


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """Fill ``object_list[i]`` with group rank i's ``obj`` on every rank.

    Example:
        >>> seen = [None] * world_size
        >>> ds_comm.all_gather_object(seen, {"rank": rank})
    """
    if (member := _member(group)) is None:
        return
    n = len(member.ranks)
    if len(object_list) != n:
        raise ValueError(
            f"all_gather_object: object_list has {len(object_list)} entries, group has {n} ranks"
        )
    payload = _to_bytes(obj, group_device(group))
    sizes, longest = _all_sizes(payload, member, group)
    gathered = payload.new_empty(n * longest)
    all_gather_into_tensor(gathered, _padded(payload, longest), group=group)
    for i in range(n):
        object_list[i] = _from_bytes(gathered[i * longest : i * longest + int(sizes[i])])


def broadcast_object_list(
    object_list: list[Any], src: int = 0, group: Any = None, device: Any = None
) -> None:
    """Replace ``object_list``'s entries on every rank with those of global rank ``src``.

    Every rank passes a list of the same length (non-source entries are overwritten).

    Example:
        >>> config = [load_config() if rank == 0 else None]
        >>> ds_comm.broadcast_object_list(config, src=0)
    """
    if (member := _member(group)) is None:
        return
    is_src = _root_index("broadcast_object_list", src, member) == member.me
    where = torch.device(device) if device is not None else group_device(group)
    count = len(object_list)
    payloads: list[torch.Tensor] = []  # filled on src only
    if is_src:
        payloads = [_to_bytes(obj, where) for obj in object_list]
        sizes = torch.tensor([p.numel() for p in payloads], dtype=torch.int64, device=where)
    else:
        sizes = torch.empty(count, dtype=torch.int64, device=where)
    broadcast(sizes, src, group=group)
    lengths = sizes.cpu().tolist()
    if is_src:
        data = torch.cat(payloads) if payloads else torch.empty(0, dtype=torch.uint8, device=where)
    else:
        data = torch.empty(sum(lengths), dtype=torch.uint8, device=where)
    broadcast(data, src, group=group)
    if not is_src:
        for i, part in enumerate(data.split(lengths)):
            object_list[i] = _from_bytes(part)


def gather_object(
    obj: Any, object_gather_list: list[Any] | None = None, dst: int = 0, group: Any = None
) -> None:
    """Collect every rank's ``obj`` into ``object_gather_list`` on global rank ``dst``.

    ``object_gather_list`` has one entry per group rank on ``dst`` and is None elsewhere.
    """
    if (member := _member(group)) is None:
        return
    n = len(member.ranks)
    is_dst = _root_index("gather_object", dst, member) == member.me
    if is_dst and (object_gather_list is None or len(object_gather_list) != n):
        got = "None" if object_gather_list is None else f"{len(object_gather_list)} entries"
        raise ValueError(
            f"gather_object: on dst {dst} object_gather_list needs {n} entries, got {got}"
        )
    payload = _to_bytes(obj, group_device(group))
    sizes, longest = _all_sizes(payload, member, group)
    outputs = [payload.new_empty(longest) for _ in range(n)] if is_dst else None
    gather(_padded(payload, longest), outputs, dst=dst, group=group)
    if is_dst:
        assert outputs is not None and object_gather_list is not None
        for i, out in enumerate(outputs):
            object_gather_list[i] = _from_bytes(out[: int(sizes[i])])


def scatter_object_list(
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    src: int = 0,
    group: Any = None,
) -> None:
    """Send ``scatter_object_input_list[i]`` from global rank ``src`` to group rank i.

    Each rank receives its object in ``scatter_object_output_list[0]``.
    """
    if (member := _member(group)) is None:
        return
    n = len(member.ranks)
    if not isinstance(scatter_object_output_list, list) or not scatter_object_output_list:
        raise ValueError("scatter_object_list: scatter_object_output_list must be a non-empty list")
    is_src = _root_index("scatter_object_list", src, member) == member.me
    where = group_device(group)
    payloads: list[torch.Tensor] = []  # filled on src only
    if is_src:
        if scatter_object_input_list is None or len(scatter_object_input_list) != n:
            got = "None" if scatter_object_input_list is None else len(scatter_object_input_list)
            raise ValueError(
                f"scatter_object_list: on src {src} scatter_object_input_list needs {n} "
                f"entries, got {got}"
            )
        payloads = [_to_bytes(obj, where) for obj in scatter_object_input_list]
        sizes = torch.tensor([p.numel() for p in payloads], dtype=torch.int64, device=where)
    else:
        sizes = torch.empty(n, dtype=torch.int64, device=where)
    broadcast(sizes, src, group=group)
    lengths = sizes.cpu().tolist()
    longest = max(lengths)
    inputs = [_padded(p, longest) for p in payloads] if is_src else None
    mine = torch.empty(longest, dtype=torch.uint8, device=where)
    scatter(mine, inputs, src=src, group=group)
    scatter_object_output_list[0] = _from_bytes(mine[: lengths[member.me]])
