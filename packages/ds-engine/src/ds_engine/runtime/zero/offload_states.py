"""``deepspeed.runtime.zero.offload_states``: where each kind of an engine's training state lives
(the engine's ``offload_states`` / ``reload_states`` move it; ds-zero does the moving)."""

from __future__ import annotations

from typing import Any

import torch

import ds_zero
from ds_zero import OffloadStateTypeEnum

__all__ = ["OffloadStateTypeEnum", "get_state_devices"]


def get_state_devices(model: Any, state: OffloadStateTypeEnum | str) -> set[torch.device]:
    """The devices holding ``state`` (an ``OffloadStateTypeEnum`` kind) of engine ``model``.

    Example:
        >>> engine.offload_states()
        >>> get_state_devices(engine, OffloadStateTypeEnum.optim_states)
        {device(type='cpu')}
    """
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise ValueError("get_state_devices(): the engine has no optimizer, so it holds no state")
    tensors = ds_zero.state_tensors(optimizer)[OffloadStateTypeEnum(state)]
    return {t.device for t in tensors if t.numel() > 0}
