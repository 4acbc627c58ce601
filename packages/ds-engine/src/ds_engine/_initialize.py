"""``initialize()`` and ``add_config_arguments()``: DeepSpeed's entry points."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

import ds_comm
from ds_engine._autotp_engine import autotp_mpu, autotp_size
from ds_engine._engine import DeepSpeedEngine
from ds_engine._sequence_parallel import (
    refuse_sequence_parallel_pipeline,
    sequence_parallel_mpu,
)
from ds_engine.api import ConfigError, DeepSpeedConfig, load_config_dict, refuse_unimplemented

__all__ = ["add_config_arguments", "initialize"]


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    """The one config the caller gave; two at once is an error (DeepSpeed asserts the same).

    ``args.deepscale_config`` is DeepSpeed's legacy name of ``args.deepspeed_config``.
    """
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    legacy = getattr(args, "deepscale_config", None) if args is not None else None
    if legacy is not None:
        if from_args is not None:
            raise ConfigError(
                "args.deepscale_config and args.deepspeed_config are both set; deepscale_config "
                "is the legacy name of deepspeed_config: keep only --deepspeed_config"
            )
        from_args = legacy
    given = {
        "config": config,
        "args.deepspeed_config": from_args,
        "config_params": config_params,
    }
    present = [name for name, value in given.items() if value is not None]
    if len(present) > 1:
        raise ConfigError(
            f"the config was given {len(present)} times ({', '.join(present)}); pass exactly one"
        )
    if not present:
        raise ConfigError(
            "no config: pass config= (a dict or a JSON path), --deepspeed_config on the command "
            "line (see add_config_arguments) or config_params="
        )
    return given[present[0]]


def _is_pipeline_module(model: Any) -> bool:
    """Whether ``model`` is a ds-pipe ``PipelineModule`` (a type check, not a name test; when
    ds-pipe was never imported no model can be one, so it is not imported here for nothing)."""
    ds_pipe = sys.modules.get("ds_pipe")
    return ds_pipe is not None and isinstance(model, ds_pipe.PipelineModule)


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | Callable[..., Any] | None = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    config: str | Mapping[str, Any] | None = None,
    mesh_param: Any = None,
    config_params: str | Mapping[str, Any] | None = None,
) -> tuple[Any, Any, Any, Any]:
    """Wrap ``model`` in a training engine configured by a DeepSpeed config.

    A ds-pipe ``PipelineModule`` gets the pipeline engine (``train_batch``/``eval_batch``; see
    [Note: the pipeline engine under initialize()] in ``_pipe.py``); ``mpu`` is then the module's
    own and the argument is ignored.

    Args:
        args: an argparse namespace; its ``deepspeed_config`` is the config path.
        model: the ``torch.nn.Module`` to train, or a ``ds_pipe.PipelineModule``.
        optimizer: a client optimizer, or a callable building one from the parameters (instead
            of the config's ``optimizer`` section).
        model_parameters: the parameters (or param groups) the optimizer updates; default
            ``model.parameters()``.
        training_data: a map-style dataset; becomes ``training_dataloader``.
        lr_scheduler: a client scheduler, or a callable building one from the optimizer.
        distributed_port: ``MASTER_PORT`` when the environment sets none.
        mpu: a model-parallel unit (Megatron's ``get_data_parallel_group`` & co.); gradients are
            reduced over its data-parallel group.
        dist_init_required: initialise ``torch.distributed`` (None: if it is not yet).
        collate_fn: batches samples of ``training_data``.
        config: a config dict or the path of a JSON file.
        mesh_param: DeepSpeed's ``(data_parallel, sequence_parallel)`` sizes: the same as
            ``sequence_parallel_size`` (docs/sequence_parallel.md).
        config_params: the same as ``config`` (DeepSpeed's older name).

    Returns:
        ``(engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler)``.

    Example:
        >>> engine, optimizer, _, _ = ds_engine.initialize(
        ...     model=model, model_parameters=model.parameters(), config="ds_config.json"
        ... )
    """
    if model is None:
        raise ValueError("initialize() needs model=, the torch.nn.Module to train")
    raw = load_config_dict(_config_source(args, config, config_params))
    refuse_unimplemented(raw)
    device_rank = getattr(args, "device_rank", None) if args is not None else None
    if _is_pipeline_module(model):
        refuse_sequence_parallel_pipeline(raw, mesh_param)
        autotp_mpu(raw, None, pipeline=True)  # AutoTP in pipeline stages: refused
        return _initialize_pipeline(
            model,
            raw,
            optimizer,
            model_parameters,
            lr_scheduler,
            training_data,
            collate_fn,
            device_rank,
        )
    if dist_init_required or (dist_init_required is None and not ds_comm.is_initialized()):
        ds_comm.init_distributed(distributed_port=distributed_port, verbose=False)
    # sequence_parallel_size / mesh_param: one ParallelGrid's sp (and AutoTP's tp) axes
    sp_size, tp_size = raw.get("sequence_parallel_size"), max(1, autotp_size(raw))
    mpu = sequence_parallel_mpu(sp_size, mpu, mesh_param=mesh_param, tp=tp_size)
    mpu = autotp_mpu(raw, mpu)  # tensor_parallel.autotp_size: a ParallelGrid's (dp = world / tp)
    dp_group = mpu.get_data_parallel_group() if mpu is not None else None
    dp_world_size = ds_comm.get_world_size(dp_group) if ds_comm.is_initialized() else 1
    parsed = DeepSpeedConfig.from_dict(raw, dp_world_size=dp_world_size)
    engine = DeepSpeedEngine(
        model,
        parsed,
        optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=lr_scheduler,
        mpu=mpu,
        training_data=training_data,
        collate_fn=collate_fn,
        config_dict=raw,
        device_rank=device_rank,
    )
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _initialize_pipeline(
    model: Any,
    raw: Mapping[str, Any],
    optimizer: Any,
    model_parameters: Any,
    lr_scheduler: Any,
    training_data: Any,
    collate_fn: Any,
    device_rank: int | None,
) -> tuple[Any, Any, Any, Any]:
    """The PipelineModule branch: the module built its process groups already (it needs an
    initialised process group), and its topology's data axis sizes the batch triad."""
    from ds_engine._pipe import PipelineDeepSpeedEngine

    parsed = DeepSpeedConfig.from_dict(raw, dp_world_size=model.grid.axis_world_size("data"))
    engine = PipelineDeepSpeedEngine(
        model,
        parsed,
        optimizer=optimizer,
        model_parameters=model_parameters,
        lr_scheduler=lr_scheduler,
        training_data=training_data,
        collate_fn=collate_fn,
        config_dict=raw,
        device_rank=device_rank,
    )
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's ``--deepspeed``, ``--deepspeed_config`` (and their legacy names
    ``--deepscale``, ``--deepscale_config``), ``--deepspeed_mpi`` and ``--local_rank`` (set by
    launchers) to ``parser``.

    Example:
        >>> parser = ds_engine.add_config_arguments(argparse.ArgumentParser())
        >>> args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed", default=False, action="store_true", help="Enable DeepSpeed (accepted)."
    )
    group.add_argument(
        "--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file."
    )
    group.add_argument(
        "--deepscale", default=False, action="store_true", help="Legacy name of --deepspeed."
    )
    group.add_argument(
        "--deepscale_config", default=None, type=str, help="Legacy name of --deepspeed_config."
    )
    group.add_argument(
        "--deepspeed_mpi",
        default=False,
        action="store_true",
        help="Discover ranks through MPI (ds-comm does this whenever launched by mpirun).",
    )
    known = {a for action in parser._actions for a in action.option_strings}
    if "--local_rank" not in known:
        group.add_argument(
            "--local_rank", "--local-rank", type=int, default=-1, help="Set by launchers."
        )
    return parser
