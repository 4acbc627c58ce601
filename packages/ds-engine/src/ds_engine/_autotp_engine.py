"""AutoTP training under the engine: ``tensor_parallel.autotp_size`` (DeepSpeed's config key).

[Note: AutoTP under the engine]
With ``"tensor_parallel": {"autotp_size": N}`` (N > 1) ``initialize()`` builds one ds-comm
``ParallelGrid(tp=N)`` (``dp = world / N``, tensor-parallel peers adjacent) unless the caller
passed an ``mpu`` whose model-parallel group has N ranks, and hands its mpu to the engine. The
engine shards the unmodified model over the grid's tp group with ``tp_model_init`` (a model that
``tp_model_init`` already sharded over the same ranks is kept as it is) before anything else
sees it. Everything else is the engine's existing model-parallel path, driven by that mpu:

- ZeRO (stages 0/1/2) reduces and partitions over the mpu's data-parallel group only;
- the loader splits batches by data-parallel rank, so the tp peers of one replica read the same
  micro-batch (what column/row-parallel layers need); as DeepSpeed does, the first forward
  compares the inputs over the tp group (a digest of every tensor argument) and raises when
  the peers were fed different batches, instead of training on garbage;
- the gradient norm sums the shards' squares over the tp group and counts a replicated
  parameter on tp rank 0 only (``model_parallel_norm_options``): each element once;
- checkpoints write one ``mp_rank_<tp>`` model file and ``zero_mp<tp>`` shards per tp rank and
  load them back onto the same layout; ``save_16bit_model`` writes merged (unsharded) weights
  through ``gather_tp_state_dict``.

ZeRO stage 3 and pipeline modules are refused with AutoTP (not implemented).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ds_comm
from ds_comm import ConfigError
from ds_engine._autotp import tp_model_init
from ds_engine._autotp_layers import is_tensor_parallel_layer

__all__ = ["apply_autotp", "autotp_mpu", "autotp_size", "is_autotp_model"]

_DTYPES = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}
_DEFAULT_DTYPE = "torch.float16"  # DeepSpeed's default; it only ever checks a given value


def autotp_size(raw: Mapping[str, Any]) -> int:
    """``tensor_parallel.autotp_size`` of a raw config dict (0 when absent)."""
    section = raw.get("tensor_parallel")
    if not isinstance(section, Mapping):
        return 0
    size = section.get("autotp_size", 0)
    if size is None:
        return 0
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ConfigError(
            f"tensor_parallel.autotp_size = {size!r}: expected a non-negative int (0 or 1: no "
            "tensor parallelism; N > 1: shard the model over N ranks)"
        )
    return size


def autotp_mpu(raw: Mapping[str, Any], mpu: Any, *, pipeline: bool = False) -> Any:
    """The mpu ``initialize()`` trains with: the caller's (checked), or a ``ParallelGrid``'s
    when ``autotp_size > 1`` asks for tensor parallelism (see [Note: AutoTP under the engine])."""
    size = autotp_size(raw)
    if size <= 1:
        return mpu
    if pipeline:
        raise NotImplementedError(
            f"tensor_parallel.autotp_size = {size} with a PipelineModule: AutoTP inside pipeline "
            "stages is not implemented in ds; remove tensor_parallel.autotp_size"
        )
    if mpu is not None:
        _check_mpu(mpu, size)
        return mpu
    world = ds_comm.get_world_size()
    if world % size:
        raise ConfigError(
            f"tensor_parallel.autotp_size = {size} does not divide the world size {world}; "
            f"choose a divisor of {world}"
        )
    return ds_comm.ParallelGrid(tp=size).mpu()


def _check_mpu(mpu: Any, size: int) -> None:
    got = mpu.get_model_parallel_world_size()
    if got != size:
        raise ConfigError(
            f"tensor_parallel.autotp_size = {size} but the mpu's model-parallel group has {got} "
            "ranks; pass an mpu whose model-parallel size is autotp_size, or no mpu (ds then "
            "builds a ParallelGrid with tp = autotp_size)"
        )


def is_autotp_model(module: nn.Module) -> bool:
    """Whether ``module`` holds tensor-parallel layers of ``tp_model_init``."""
    return any(is_tensor_parallel_layer(m) for m in module.modules())


def _model_dtype(model: nn.Module) -> torch.dtype:
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.get_default_dtype()


def _check_dtype(config: Any, size: int) -> None:
    value = config.unimplemented.tensor_parallel.dtype
    if value is None or str(value) == _DEFAULT_DTYPE:
        return
    name = str(value).removeprefix("torch.").lower()
    wanted = _DTYPES.get(name)
    if wanted is None:
        raise ConfigError(
            f"tensor_parallel.dtype = {value!r}: expected one of {sorted(_DTYPES)} (or torch.<name>)"
        )
    engine = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.param_dtype_name)
    engine = engine or torch.float32
    if wanted != engine:
        raise ConfigError(
            f"tensor_parallel.dtype = {value!r} conflicts with the engine's parameter dtype "
            f"{engine} (set by bf16/fp16); make them agree or remove tensor_parallel.dtype"
        )


def _ranks(group: Any) -> list[int]:
    if group is None:
        return list(range(ds_comm.get_world_size()))
    return sorted(dist.get_process_group_ranks(group))


def _check_sharded(model: nn.Module, size: int, group: Any) -> None:
    """A model ``tp_model_init`` already sharded must use the grid's tp ranks."""
    wanted = _ranks(group)
    for name, module in model.named_modules():
        if not is_tensor_parallel_layer(module):
            continue
        ranks = _ranks(module.group)
        if module.tp_size != size or ranks != wanted:
            raise ConfigError(
                f"tensor_parallel.autotp_size = {size}: {name!r} was sharded by tp_model_init "
                f"over ranks {ranks}, but the engine's tensor-parallel group is {wanted}; call "
                "tp_model_init with tp_group=mpu.get_model_parallel_group(), or pass the "
                "unsharded model and let the engine shard it"
            )


def apply_autotp(model: nn.Module, config: Any, mpu: Any) -> Any:
    """Shard ``model`` in place over the tensor-parallel group when the config asks for AutoTP;
    return the mpu the engine trains with (see [Note: AutoTP under the engine])."""
    size = int(config.unimplemented.tensor_parallel.autotp_size or 0)
    if size <= 1:
        return mpu
    if config.zero_optimization.stage >= 3:
        raise NotImplementedError(
            f"tensor_parallel.autotp_size = {size} with zero_optimization.stage 3: ZeRO-3 over "
            "tensor-parallel shards is not implemented in ds; use stage 0, 1 or 2"
        )
    _check_dtype(config, size)
    if mpu is None:  # an engine built directly, not through initialize()
        mpu = autotp_mpu({"tensor_parallel": {"autotp_size": size}}, None)
    _check_mpu(mpu, size)
    group = mpu.get_model_parallel_group()
    if is_autotp_model(model):
        _check_sharded(model, size, group)
    else:
        tp_model_init(model, size, _model_dtype(model), tp_group=group)
    _check_first_inputs(model, group)
    return mpu


def _tensors(value: Any) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _check_first_inputs(model: nn.Module, group: Any) -> None:
    """A one-shot forward pre-hook: the tp peers' first inputs must be the same batch."""

    def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
        handle.remove()
        tensors = _tensors((args, kwargs))
        device = tensors[0].device if tensors else torch.device("cpu")
        digest = torch.zeros(4, dtype=torch.float64, device=device)
        for t in tensors:
            values = t.detach().to(torch.float64)
            digest += torch.stack(
                [
                    values.new_tensor(1.0),
                    values.new_tensor(t.numel()),
                    values.sum(),
                    values.square().sum(),
                ]
            )
        size = ds_comm.get_world_size(group)
        parts = [torch.empty_like(digest) for _ in range(size)]
        ds_comm.all_gather(parts, digest, group=group)
        if any(not torch.equal(p, parts[0]) for p in parts):
            raise RuntimeError(
                "tensor_parallel.autotp_size: the tensor-parallel ranks of one replica were "
                f"given different inputs in their first forward (group ranks {_ranks(group)}); "
                "they must see the same micro-batch: use the engine's loader (training_data= "
                "or deepspeed_io), which splits by data-parallel rank, or split your data by "
                "engine.dp_rank / engine.dp_world_size"
            )

    handle = model.register_forward_pre_hook(hook, prepend=True, with_kwargs=True)
