"""DeepSpeed's config accessors (``gradient_clipping()``, ``zero_*()``, ...), generated.

[Note: one mechanism for the accessors]
DeepSpeed's engine has about 120 methods that only return a config field. Here they are data: a
table maps each accessor name to the dotted path of its field in the parsed config
(``"zero_max_live_parameters": "zero_optimization.stage3_max_live_parameters"``), and
:func:`install_config_accessors` turns every row into a method that reads ``self._config``
along that path. The table is the config's (``ds_engine._config_accessors.DEEPSPEED_ACCESSORS``,
kept next to the config models it points into); :data:`ENGINE_ACCESSORS` adds the rows for
fields this module knows of when that table does not list them. Accessors whose value is
derived (``dynamic_loss_scale()`` is ``loss_scale == 0``, ``zero_optimization()`` is
``stage > 0``) are written out in ``_engine_surface.py`` and win over a table row of the same
name. ``tests/test_engine_surface.py`` checks that every row resolves on a default config.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["ENGINE_ACCESSORS", "accessor_table", "install_config_accessors", "read_path"]

# Rows for the fields the config models hold (DeepSpeed accessor name -> dotted field path).
ENGINE_ACCESSORS: dict[str, str] = {
    "train_batch_size": "train_batch_size",
    "train_micro_batch_size_per_gpu": "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "gradient_clipping": "gradient_clipping",
    "steps_per_print": "steps_per_print",
    "wall_clock_breakdown": "wall_clock_breakdown",
    "memory_breakdown": "memory_breakdown",
    "gradient_predivide_factor": "gradient_predivide_factor",
    "zero_allow_untested_optimizer": "zero_allow_untested_optimizer",
    "fp16_enabled": "fp16.enabled",
    "fp16_auto_cast": "fp16.auto_cast",
    "loss_scale": "fp16.loss_scale",
    "fp16_master_weights_and_gradients": "fp16.fp16_master_weights_and_grads",
    "bfloat16_enabled": "bf16.enabled",
    "bf16_master_weights_and_gradients": "bf16.bf16_master_weights_and_grads",
    "bf16_optimizer_states": "bf16.bf16_optimizer_states",
    "zero_optimization_stage": "zero_optimization.stage",
    "zero_contiguous_gradients": "zero_optimization.contiguous_gradients",
    "zero_reduce_scatter": "zero_optimization.reduce_scatter",
    "zero_reduce_bucket_size": "zero_optimization.reduce_bucket_size",
    "zero_allgather_partitions": "zero_optimization.allgather_partitions",
    "zero_allgather_bucket_size": "zero_optimization.allgather_bucket_size",
    "zero_overlap_comm": "zero_optimization.overlap_comm",
    "zero_round_robin_gradients": "zero_optimization.round_robin_gradients",
    "zero_offload_optimizer": "zero_optimization.offload_optimizer",
    "zero_offload_param": "zero_optimization.offload_param",
    "zero_partial_offload": "zero_optimization.offload_optimizer.ratio",
    "zero_elastic_checkpoint": "zero_optimization.elastic_checkpoint",
    "zero_load_from_fp32_weights": "zero_optimization.load_from_fp32_weights",
    "zero_ignore_unused_parameters": "zero_optimization.ignore_unused_parameters",
    "zero_multi_rank_bucket_allreduce": "zero_optimization.use_multi_rank_bucket_allreduce",
    "zero_prefetch_bucket_size": "zero_optimization.stage3_prefetch_bucket_size",
    "zero_param_persistence_threshold": "zero_optimization.stage3_param_persistence_threshold",
    "zero_max_live_parameters": "zero_optimization.stage3_max_live_parameters",
    "zero_max_reuse_distance": "zero_optimization.stage3_max_reuse_distance",
    "zero_gather_16bit_weights_on_model_save": (
        "zero_optimization.stage3_gather_16bit_weights_on_model_save"
    ),
    "zero_sub_group_size": "zero_optimization.sub_group_size",
    "aio_config": "aio",
}

_CONFIG_TABLE = ("ds_engine._config_accessors", "DEEPSPEED_ACCESSORS")


def accessor_table() -> dict[str, str]:
    """Every accessor row: the config's table over :data:`ENGINE_ACCESSORS` (see [Note: one
    mechanism for the accessors])."""
    table = dict(ENGINE_ACCESSORS)
    module_name, attribute = _CONFIG_TABLE
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
    else:
        table.update(getattr(module, attribute))
    return table


def read_path(config: Any, path: str) -> Any:
    """The value at dotted ``path`` in ``config``: attributes of the config models, or keys
    where a section is a plain mapping (``optimizer.params``)."""
    value = config
    for part in path.split("."):
        if hasattr(value, part) or not isinstance(value, Mapping):
            value = getattr(value, part)
        else:
            value = value[part]
    return value


def _accessor(name: str, path: str) -> Callable[[Any], Any]:
    def accessor(self: Any) -> Any:
        return read_path(self._config, path)

    accessor.__name__ = accessor.__qualname__ = name
    accessor.__doc__ = f"DeepSpeed's ``{name}()``: the config's ``{path}``."
    return accessor


def install_config_accessors(cls: type, table: Mapping[str, str] | None = None) -> type:
    """Give ``cls`` one method per row of ``table`` (default :func:`accessor_table`), reading
    ``self._config``; names ``cls`` defines itself are kept (derived accessors)."""
    for name, path in (table if table is not None else accessor_table()).items():
        if any(name in vars(base) for base in cls.__mro__ if base is not object):
            continue
        setattr(cls, name, _accessor(name, path))
    return cls
