"""Constant-size buckets: many small tensors flattened into a few flat buffers, one collective each.

A collective has a fixed latency cost, so reducing a model's hundreds of gradients one by one is
latency-bound; packing them into buffers of ``bucket_size_bytes`` (DeepSpeed's
``reduce_bucket_size``/``allgather_bucket_size``) pays that cost once per bucket instead.

Example:
    >>> grads = [p.grad for p in model.parameters()]
    >>> for bucket in flatten_into_buckets(grads, 25 * 2**20):
    ...     ds_comm.all_reduce(bucket.buffer, group=group)
    ...     bucket.copy_back()
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["Bucket", "flatten_into_buckets", "unflatten_bucket"]


@dataclass(eq=False)
class Bucket:
    """A flat 1-D buffer holding copies of ``tensors`` back to back (plus zero padding at the end).

    Attributes:
        buffer: the flat buffer handed to a collective; ``buffer.numel()`` includes padding.
        tensors: the member tensors, in the order given to :func:`flatten_into_buckets`.
        offsets: element offset of each member in ``buffer``.
    """

    buffer: torch.Tensor
    tensors: list[torch.Tensor]
    offsets: list[int]

    @property
    def used_numel(self) -> int:
        """Elements occupied by members; ``buffer.numel() - used_numel`` is alignment padding."""
        if not self.tensors:
            return 0
        return self.offsets[-1] + self.tensors[-1].numel()

    def views(self) -> list[torch.Tensor]:
        """Views into ``buffer`` shaped like each member (no copies)."""
        return [
            self.buffer.narrow(0, off, t.numel()).view(t.shape)
            for t, off in zip(self.tensors, self.offsets)
        ]

    def copy_back(self) -> None:
        """Write the buffer's (e.g. reduced) contents back into the member tensors, casting dtype."""
        with torch.no_grad():
            for t, view in zip(self.tensors, self.views()):
                if t.data_ptr() != view.data_ptr():
                    t.copy_(view)

    def alias_members(self) -> None:
        """Re-point each member's ``.data`` at its view in ``buffer``, so later writes land there.

        After this, whatever writes a member (an optimizer step, a gradient accumulation) writes the
        buffer, and the next collective needs no flatten copy, as with DeepSpeed's contiguous
        gradient buffers. Members keep their identity (``nn.Parameter`` objects stay registered).
        The buffer must have the members' dtype (``flatten_into_buckets(..., dtype=None)``).
        """
        for t, view in zip(self.tensors, self.views()):
            if t.dtype != view.dtype:
                raise TypeError(
                    f"cannot alias a {t.dtype} tensor to a {view.dtype} bucket; "
                    "flatten with dtype=None to alias members"
                )
            t.data = view


def unflatten_bucket(bucket: Bucket) -> list[torch.Tensor]:
    """Views into ``bucket.buffer`` shaped like the bucket's members (no copies).

    Example:
        >>> (bucket,) = flatten_into_buckets([a, b], 2**20)
        >>> a_view, b_view = unflatten_bucket(bucket)
        >>> a_view.data_ptr() == bucket.buffer.data_ptr()
        True
    """
    return bucket.views()


def flatten_into_buckets(
    tensors: Iterable[torch.Tensor],
    bucket_size_bytes: int,
    *,
    dtype: torch.dtype | None = None,
    align_elements: int = 1,
) -> list[Bucket]:
    """Group ``tensors`` into buckets of about ``bucket_size_bytes`` and copy each into a flat buffer.

    Tensors sharing a buffer dtype and device fill one open bucket in their given order; a bucket
    is closed when the next tensor would push it past ``bucket_size_bytes``, so no bucket exceeds
    the size unless one tensor alone does (that tensor gets a bucket of its own). Interleaved
    dtypes or devices therefore do not fragment buckets. Buckets are returned in the order of
    their first member.

    Args:
        tensors: tensors to pack (any shape, contiguous or not; ``None`` is not allowed).
        bucket_size_bytes: target bucket size in bytes of the buffer dtype.
        dtype: buffer dtype (e.g. ``torch.float32`` to reduce bf16 gradients in fp32); by default
            each tensor's own dtype.
        align_elements: pad each buffer with zeros to a multiple of this many elements, e.g. the
            world size, so ``reduce_scatter_tensor`` can split it evenly.

    Example:
        >>> buckets = flatten_into_buckets(grads, 25 * 2**20, align_elements=world_size)
        >>> [b.buffer.numel() % world_size for b in buckets]
        [0, 0]
    """
    if bucket_size_bytes <= 0:
        raise ValueError(f"bucket_size_bytes must be positive, got {bucket_size_bytes}")
    if align_elements < 1:
        raise ValueError(f"align_elements must be >= 1, got {align_elements}")
    groups = _assign(list(tensors), bucket_size_bytes, dtype)
    return [_pack(members, dtype or members[0].dtype, align_elements) for members in groups]


@dataclass
class _OpenBucket:
    first_index: int
    members: list[torch.Tensor]
    nbytes: int


def _assign(
    tensors: Sequence[torch.Tensor], bucket_size_bytes: int, dtype: torch.dtype | None
) -> list[list[torch.Tensor]]:
    open_buckets: dict[tuple[torch.dtype, torch.device], _OpenBucket] = {}
    closed: list[_OpenBucket] = []
    for index, t in enumerate(tensors):
        key = (dtype or t.dtype, t.device)
        nbytes = t.numel() * key[0].itemsize
        bucket = open_buckets.get(key)
        if bucket is not None and bucket.nbytes + nbytes > bucket_size_bytes:
            closed.append(bucket)
            bucket = None
        if bucket is None:
            bucket = open_buckets[key] = _OpenBucket(index, [], 0)
        bucket.members.append(t)
        bucket.nbytes += nbytes
    closed.extend(open_buckets.values())
    closed.sort(key=lambda b: b.first_index)
    return [b.members for b in closed]


def _pack(members: list[torch.Tensor], dtype: torch.dtype, align_elements: int) -> Bucket:
    offsets: list[int] = []
    total = 0
    for t in members:
        offsets.append(total)
        total += t.numel()
    padded = -(-total // align_elements) * align_elements
    buffer = torch.empty(padded, dtype=dtype, device=members[0].device)
    buffer[total:].zero_()
    bucket = Bucket(buffer=buffer, tensors=members, offsets=offsets)
    with torch.no_grad():
        for t, view in zip(members, bucket.views()):
            view.copy_(t)
    return bucket
