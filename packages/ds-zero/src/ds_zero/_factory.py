"""``build_zero_optimizer``: the ZeRO optimizer a ``zero_optimization`` section asks for: the
step core (``_core.py``, [Note: one step]) with the strategies its flags choose."""

from __future__ import annotations

from typing import Any

import torch

from ds_zero._optimizer import ZeroOptimizer
from ds_zero._stage3_optimizer import Stage3Optimizer
from ds_zero.api import ZeroConfig

__all__ = ["build_zero_optimizer"]


def build_zero_optimizer(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: ZeroConfig | None = None,
    **kwargs: Any,
) -> ZeroOptimizer | Stage3Optimizer:
    """The step core with the strategies ``config``'s flags choose: ``shard_parameters``
    (stage 3) gives :class:`~ds_zero.Stage3Optimizer` (per-parameter shards, partitioned
    parameters), otherwise :class:`~ds_zero.ZeroOptimizer` (flat buckets, whole parameters;
    ``shard_optimizer_state``/``shard_gradients`` set how the buckets are sharded).

    Args:
        model: the module to train.
        optimizer: a ``torch.optim`` optimizer over its trainable parameters, without state.
        config: the ``zero_optimization`` section (default: stage 0).
        **kwargs: the keyword arguments of the chosen class (``group``, ``loss_scaler``,
            ``gradient_accumulation_steps``, ...).

    Raises:
        ValueError: a keyword argument the chosen stage does not support.

    Example:
        >>> zero = build_zero_optimizer(model, torch.optim.AdamW(model.parameters()),
        ...                             ZeroConfig.from_dict({"stage": 3}), group=dp_group)
    """
    config = config if config is not None else ZeroConfig()
    if config.shard_parameters:  # stage 3: per-parameter shards, partitioned residency
        return Stage3Optimizer(model, optimizer, config, **kwargs)
    if kwargs.get("partitioner") is not None:
        raise ValueError(
            f"partitioner= is for stage 3 (partitioned parameters); zero_optimization.stage = "
            f"{config.stage} keeps parameters whole: drop it or set stage to 3"
        )
    kwargs.pop("partitioner", None)
    # Stages 0-2 save param groups with their own process groups in the per-rank format (see
    # _checkpoint.py's [Note: resharding a checkpoint]), which does not name tensors.
    kwargs.pop("checkpoint_names", None)
    return ZeroOptimizer(model, optimizer, config, **kwargs)
