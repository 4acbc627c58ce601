"""What the engine and the pipeline engine build the same way from a config: the client
optimizer, the LR schedule and the gradient-step core (ds-zero's) around the optimizer."""

from __future__ import annotations

from typing import Any, cast

import torch

from ds_engine.api import ConfigError, DeepSpeedConfig
from ds_optim import GradientStep, build_lr_scheduler, build_optimizer
from ds_zero import SelfReducingStep, build_zero_optimizer

__all__ = [
    "build_client_optimizer",
    "build_gradient_step",
    "build_scheduler",
    "is_model_parallel_parameter",
    "model_parallel_norm_options",
]


def build_client_optimizer(
    config: DeepSpeedConfig, optimizer: Any, params: Any, *, group: Any
) -> torch.optim.Optimizer | None:
    """The torch optimizer to train with: the client's (an optimizer, or a callable taking the
    parameters), else the config's ``optimizer`` section (None when neither is given).

    Raises:
        ConfigError: both a client optimizer and an ``optimizer`` section were given.
    """
    section = config.optimizer
    if optimizer is not None and section is not None:
        raise ConfigError(
            "optimizer: both a client optimizer and an 'optimizer' config section were "
            "given; remove one of them"
        )
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        return cast(torch.optim.Optimizer, optimizer(params))  # the client's factory
    if section is None:
        return None
    offload = config.zero_optimization.offload_optimizer.enabled
    return build_optimizer(section, params, offload=offload, group=group)


def build_scheduler(
    config: DeepSpeedConfig, lr_scheduler: Any, optimizer: torch.optim.Optimizer | None
) -> Any:
    """The LR schedule over ``optimizer``: the client's (a scheduler, or a callable taking the
    optimizer), else the config's ``scheduler`` section (None when neither is given).

    Raises:
        ConfigError: both a client scheduler and a ``scheduler`` section were given.
    """
    if lr_scheduler is not None and config.scheduler is not None:
        raise ConfigError(
            "scheduler: both a client lr_scheduler and a 'scheduler' config section were "
            "given; remove one of them"
        )
    if optimizer is None:
        return None
    if lr_scheduler is not None:
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            return lr_scheduler(optimizer)
        return lr_scheduler
    if config.scheduler is None:
        return None
    return build_lr_scheduler(config.scheduler, optimizer)


def build_gradient_step(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: DeepSpeedConfig,
    *,
    group: Any,
    loss_scaler: Any,
    **zero_options: Any,
) -> GradientStep:
    """ds-zero's gradient-step core over ``optimizer`` at the config's ZeRO stage (the layout
    of an optimizer that reduces its own gradients at stage 0), for either engine.

    Args:
        module: the module (or pipeline stage) it trains.
        optimizer: the client optimizer.
        config: the parsed config (stage, accumulation, clipping).
        group: the data-parallel group.
        loss_scaler: the fp16 loss scaler (None without fp16).
        **zero_options: further keyword arguments of ``ds_zero.build_zero_optimizer``
            (``norm_group``, ``swapper``, ``param_group_process_groups``, ...).
    """
    zero = config.zero_optimization
    if getattr(optimizer, "reduces_gradients", False):
        if zero.stage != 0:
            raise ConfigError(
                f"zero_optimization.stage = {zero.stage}: {type(optimizer).__name__} reduces "
                "its own gradients and needs stage 0"
            )
        return SelfReducingStep(
            module,
            optimizer,
            group=group,
            loss_scaler=loss_scaler,
            gradient_accumulation_steps=config.gradient_accumulation_steps,
        )
    return build_zero_optimizer(
        module,
        optimizer,
        zero,
        group=group,
        loss_scaler=loss_scaler,
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        gradient_clipping=config.gradient_clipping,
        **zero_options,
    )


def is_model_parallel_parameter(param: torch.Tensor) -> bool:
    """Whether ``param`` is a shard split over the model-parallel group (Megatron/DeepSpeed
    mark those ``model_parallel = True`` or ``tensor_model_parallel = True``)."""
    return bool(getattr(param, "model_parallel", False)) or bool(
        getattr(param, "tensor_model_parallel", False)
    )


def model_parallel_norm_options(module: torch.nn.Module, mpu: Any) -> dict[str, Any]:
    """ds-zero's ``norm_group``/``norm_exclude`` that make the gradient norm global over an
    mpu's model-parallel group, each element counted once (empty without model parallelism).

    A model-parallel parameter's shards are disjoint, so every rank's squares are summed over
    the group; a replicated parameter (unmarked) is identical on every model-parallel rank, so
    only model-parallel rank 0 counts it, as DeepSpeed's ``clip_grad_norm_`` does.
    """
    if mpu is None or mpu.get_model_parallel_world_size() <= 1:
        return {}
    exclude: list[torch.nn.Parameter] = []
    if mpu.get_model_parallel_rank() != 0:
        exclude = [p for p in module.parameters() if not is_model_parallel_parameter(p)]
    return {"norm_group": mpu.get_model_parallel_group(), "norm_exclude": exclude}
