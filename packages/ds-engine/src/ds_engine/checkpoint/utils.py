"""``deepspeed.checkpoint.utils``: ``clone_tensors_for_torch_save``."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["clone_tensors_for_torch_save"]


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = "cpu") -> Any:
    """``item`` with every tensor copied onto ``device`` into storage of its own size.

    ``torch.save`` writes a tensor's whole storage: a view into a flat buffer (a ZeRO partition,
    a gathered 16-bit weight) would drag the whole buffer into the file. Lists, tuples and dicts
    are walked; other values pass through.

    Example:
        >>> torch.save(clone_tensors_for_torch_save(model.state_dict()), "model.pt")
    """
    if torch.is_tensor(item):
        target = torch.device(device)
        if item.device == target:
            return item.detach().clone()
        return item.detach().to(target)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        cloned = [clone_tensors_for_torch_save(v, device) for v in item]
        return type(item)(*cloned) if hasattr(item, "_fields") else tuple(cloned)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
