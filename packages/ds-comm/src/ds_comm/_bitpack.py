"""Sign bits packed 8 per byte, with vectorised torch bit ops (no Python loop over elements).

Bit order is most-significant first: element ``8*i + k`` lands in bit ``7 - k`` of byte ``i``, as
``numpy.packbits`` does, so packed buffers can be checked against numpy. A set bit means the value
is non-negative: zero compresses to ``+1``, which keeps ``scale * sign`` a non-zero vector for an
all-zero input (DeepSpeed's ``sign().add_(1).bool()`` makes the same choice).
"""

from __future__ import annotations

import torch

__all__ = ["pack_signs", "unpack_signs"]


def _shifts(device: torch.device) -> torch.Tensor:
    return torch.arange(7, -1, -1, dtype=torch.uint8, device=device)


def pack_signs(values: torch.Tensor) -> torch.Tensor:
    """Pack ``values >= 0`` into a 1-D ``uint8`` tensor of ``values.numel() // 8`` bytes.

    Args:
        values: any floating tensor whose number of elements is a multiple of 8.

    Example:
        >>> pack_signs(torch.tensor([1.0, -1, 0, -2, 3, -3, 4, -4]))
        tensor([170], dtype=torch.uint8)
    """
    if values.numel() % 8:
        raise ValueError(f"pack_signs needs a multiple of 8 elements, got {values.numel()}")
    bits = values.reshape(-1, 8).ge(0).to(torch.uint8)
    # The eight shifted bits of a byte are disjoint, so their sum is their bitwise OR.
    return bits.bitwise_left_shift_(_shifts(values.device)).sum(dim=1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Expand packed bytes back to a 1-D tensor of ``+1``/``-1`` with ``8 * packed.numel()`` elements.

    Example:
        >>> unpack_signs(torch.tensor([170], dtype=torch.uint8))
        tensor([ 1., -1.,  1., -1.,  1., -1.,  1., -1.])
    """
    bits = packed.reshape(-1, 1).bitwise_right_shift(_shifts(packed.device)).bitwise_and_(1)
    return bits.reshape(-1).to(dtype).mul_(2).sub_(1)
