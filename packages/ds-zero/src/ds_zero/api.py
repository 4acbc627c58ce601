"""Public types of ds-zero: the ``zero_optimization`` config section, memory reports, protocols.

``ZeroConfig.from_dict`` reads DeepSpeed's whole ``zero_optimization`` section. The stage 3 keys
(``offload_param``, ``sub_group_size``, ``stage3_prefetch_bucket_size``, ...) are fields of
:class:`ZeroConfig`, read under their DeepSpeed names and aliases (``prefetch_bucket_size``, ...);
stages 0-2 ignore them. Keys for ZeRO++, MiCS, ZenFlow and the rarer stage 3 knobs are one table
(see [Note: zero keys refused only when requested]). Deprecated keys (``cpu_offload``, ...) are
translated into the offload sections they stand for, as DeepSpeed does. ``"auto"`` (Hugging
Face's placeholder) is a key's default. Anything else unknown is an error with the closest known
key.
"""

from __future__ import annotations

import enum
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol, runtime_checkable

import torch

from ds_comm import ConfigError
from ds_comm.api import as_section, check_keys, is_auto

__all__ = [
    "ConfigError",
    "MemoryBreakdown",
    "OffloadOptimizerConfig",
    "OffloadStateTypeEnum",
    "OffloadParamConfig",
    "TensorSwapper",
    "ZeroConfig",
]

_SECTION = "zero_optimization"
_OFFLOAD_DEVICES = ("none", "cpu", "nvme")

# Aliases DeepSpeed accepts for the stage 3 fields of ZeroConfig.
_ALIASES: dict[str, str] = {
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
}

# [Note: zero keys refused only when requested]
# DeepSpeed's zero_optimization keys for features ds does not implement, under their canonical
# names, with DeepSpeed's default and the feature. A value equal to the default (or "auto")
# configures nothing and is accepted and kept in ZeroConfig.unimplemented (the engine's
# accessors read it there); any other value asks for the feature and is a ConfigError.
_REFUSED_WHEN_REQUESTED: dict[str, tuple[Any, str]] = {
    "model_persistence_threshold": (sys.maxsize, "a whole-model persistence budget"),
    "module_granularity_threshold": (0, "leaf-module granularity fetching"),
    "use_all_reduce_for_fetch_params": (False, "all-reduce parameter fetches"),
    "allgather_sequential": (False, "sequential parameter all-gathers"),
    "memory_efficient_linear": (True, "turning off the memory-efficient linear"),
    "override_module_apply": (True, "not overriding Module.apply"),
    "pipeline_loading_checkpoint": (False, "pipelined checkpoint loading"),
    "zero_quantized_nontrainable_weights": (False, "ZeRO++ quantized frozen weights"),
    "zeropp_loco_param": (None, "LoCo-ZeRO++"),
    "mics_hierarchical_params_gather": (False, "MiCS hierarchical gathers"),
    "legacy_stage1": (False, "the legacy stage 1 implementation"),
    "log_trace_cache_warnings": (False, "trace-cache warnings"),
    "compute_grad_norm": (True, "skipping the gradient norm"),
    "parameter_alignment": (False, "parameter alignment padding"),
    "enable_sanity_checks": (False, "ZeRO-3 sanity checks"),
    "save_muon_momentum_buffer_in_memory": (False, "the Muon optimizer's NVMe options"),
    "zenflow": (None, "ZenFlow"),
    "leaf_module": (None, "leaf modules"),
}
_ALIASES.update(
    {
        "stage3_model_persistence_threshold": "model_persistence_threshold",
        "stage3_module_granularity_threshold": "module_granularity_threshold",
        "stage3_use_all_reduce_for_fetch_params": "use_all_reduce_for_fetch_params",
        "stage3_allgather_sequential": "allgather_sequential",
    }
)
# Deprecated keys DeepSpeed still translates: key -> (target offload section, setting).
_DEPRECATED: dict[str, tuple[tuple[str, ...], str, Any]] = {
    "cpu_offload": (("offload_optimizer",), "device", "cpu"),
    "cpu_offload_param": (("offload_param",), "device", "cpu"),
    "cpu_offload_use_pin_memory": (("offload_optimizer", "offload_param"), "pin_memory", True),
}


def _bool(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where} = {value!r}: expected true or false")
    return value


def _count(where: str, value: Any, *, minimum: int) -> int:
    """An integer (``5e8`` is accepted: JSON configs write bucket sizes that way)."""
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not integral or value < minimum:
        raise ConfigError(f"{where} = {value!r}: expected an integer >= {minimum}")
    return int(value)


class _OffloadTarget:
    """What both offload sections share: ``device``, ``nvme_path``, ``enabled``, ``from_dict``."""

    _KEY = ""  # the section's key under zero_optimization
    device: str
    nvme_path: str | None

    def _check_target(self) -> str:
        """Validate ``device`` and ``nvme_path``; return the section's config path."""
        where = f"{_SECTION}.{self._KEY}"
        if self.device not in _OFFLOAD_DEVICES:
            raise ConfigError(
                f"{where}.device = {self.device!r}: expected one of {list(_OFFLOAD_DEVICES)}"
            )
        if self.device == "nvme" and not self.nvme_path:
            raise ConfigError(
                f'{where}.nvme_path = {self.nvme_path!r}: device "nvme" needs a directory on the '
                "NVMe drive, e.g. /local_nvme"
            )
        if self.nvme_path is not None and not isinstance(self.nvme_path, str):
            object.__setattr__(self, "nvme_path", str(self.nvme_path))
        return where

    @property
    def enabled(self) -> bool:
        """True when the data lives off the compute device (``device`` is cpu or nvme)."""
        return self.device != "none"

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> Any:
        """Build from the JSON mapping (``None`` means no offload)."""
        where = f"{_SECTION}.{cls._KEY}"
        section = as_section(where, section)
        check_keys(where, section, (f.name for f in fields(cls)))  # type: ignore[arg-type]
        return cls(**section)


@dataclass(frozen=True, kw_only=True)
class OffloadOptimizerConfig(_OffloadTarget):
    """``zero_optimization.offload_optimizer``: ZeRO-Offload of the optimizer (stages 1 and 2).

    Attributes:
        device: ``"none"``, ``"cpu"`` (fp32 partitions, gradients and optimizer state in host
            memory, stepped on the CPU) or ``"nvme"`` (as cpu, with optimizer state swapped to
            ``nvme_path`` between steps through a :class:`TensorSwapper`).
        nvme_path: directory for swapped optimizer state; required with ``device="nvme"``.
        buffer_count: swap buffers in the pool (DeepSpeed: at least the optimizer's states per
            parameter); handed to the swapper.
        pin_memory: page-locked host buffers (faster host-device copies; CUDA only).
        pipeline_read: overlap reading the next tile with the step (ZeRO-Infinity); recorded.
        pipeline_write: overlap writing the previous tile with the step; recorded.
        fast_init: skip the initial swap-out of zero state (nvme).
        ratio: fraction of optimizer state offloaded; below 1.0 is stage 3 only in DeepSpeed.
        super_offload: DeepSpeed's SuperOffload (GH200-style); not implemented (false only).
        cpuadam_cores_perc: share of cores SuperOffload's CPU Adam uses; only DeepSpeed's
            default 0.8 (it configures SuperOffload).
    """

    device: str = "none"
    nvme_path: str | None = None
    buffer_count: int = 4
    pin_memory: bool = True
    pipeline_read: bool = False
    pipeline_write: bool = False
    fast_init: bool = False
    ratio: float = 1.0
    super_offload: bool = False
    cpuadam_cores_perc: float = 0.8

    _KEY = "offload_optimizer"

    def __post_init__(self) -> None:
        where = self._check_target()
        object.__setattr__(
            self, "buffer_count", _count(f"{where}.buffer_count", self.buffer_count, minimum=0)
        )
        for name in ("pin_memory", "pipeline_read", "pipeline_write", "fast_init"):
            _bool(f"{where}.{name}", getattr(self, name))
        ratio = self.ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
            raise ConfigError(f"{where}.ratio = {ratio!r}: expected a number in [0, 1]")
        if ratio < 1:
            raise ConfigError(
                f"{where}.ratio = {ratio!r} asks for partial optimizer offload (only that "
                "fraction of the optimizer step on the CPU; a ZeRO stage 3 feature in DeepSpeed), "
                "which is not implemented in ds; use 1.0 (the whole optimizer step offloaded)"
            )
        object.__setattr__(self, "ratio", float(ratio))
        if _bool(f"{where}.super_offload", self.super_offload):
            raise ConfigError(
                f"{where}.super_offload = true asks for SuperOffload, which is not implemented "
                "in ds; set it to false (ZeRO-Offload to the CPU works)"
            )
        if self.cpuadam_cores_perc != 0.8 or isinstance(self.cpuadam_cores_perc, bool):
            raise ConfigError(
                f"{where}.cpuadam_cores_perc = {self.cpuadam_cores_perc!r} configures "
                "SuperOffload, which is not implemented in ds; remove it (default 0.8)"
            )


@dataclass(frozen=True, kw_only=True)
class OffloadParamConfig(_OffloadTarget):
    """``zero_optimization.offload_param``: where stage 3 keeps parameter shards (ZeRO-Infinity).

    Attributes:
        device: ``"none"`` (shards on the compute device), ``"cpu"`` (host memory, copied to the
            compute device for each gather) or ``"nvme"`` (files under ``nvme_path``, fetched
            through a ``ShardStore``).
        pin_memory: page-locked host shards (faster host-device copies; CUDA only).
        nvme_path: directory for the shard files; required with ``device="nvme"``.
        buffer_count: host buffers the nvme store cycles through.
        buffer_size: elements per nvme host buffer.
        max_in_cpu: elements of shards the nvme store may keep in host memory.
    """

    device: str = "none"
    pin_memory: bool = True
    nvme_path: str | None = None
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000

    _KEY = "offload_param"

    def __post_init__(self) -> None:
        where = self._check_target()
        _bool(f"{where}.pin_memory", self.pin_memory)
        for name, minimum in (("buffer_count", 1), ("buffer_size", 1), ("max_in_cpu", 0)):
            value = _count(f"{where}.{name}", getattr(self, name), minimum=minimum)
            object.__setattr__(self, name, value)


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """The ``zero_optimization`` config section, with DeepSpeed's key names and defaults.

    A stage is a pair of flags, not a class: :attr:`shard_optimizer_state` (stage >= 1) and
    :attr:`shard_gradients` (stage >= 2). Bucket sizes count elements, as in DeepSpeed.

    Attributes:
        stage: 0 (data parallel), 1 (optimizer state sharded) or 2 (and gradients).
        contiguous_gradients: stage 2: copy each gradient into a preallocated bucket buffer as
            soon as it is produced, and free it (stages 0/1 always keep gradients in one flat
            buffer).
        reduce_scatter: reduce gradients with reduce-scatter (each rank receives its shard)
            instead of all-reduce (every rank receives everything and keeps its shard).
        reduce_bucket_size: elements per gradient reduction bucket.
        allgather_partitions: re-assemble updated parameters with all-gather (else one
            broadcast per rank).
        allgather_bucket_size: elements gathered per all-gather after the step.
        overlap_comm: run gradient reductions asynchronously while backward continues (a side
            stream on CUDA, async work handles on gloo). DeepSpeed's default is stage == 3.
        round_robin_gradients: DeepSpeed's parallel gradient copy to CPU under offload; each
            rank already copies only its own shard here, so it changes nothing.
        offload_optimizer: see :class:`OffloadOptimizerConfig`.
        elastic_checkpoint: allow loading a sharded checkpoint saved with another data-parallel
            world size (re-partitioning it).
        load_from_fp32_weights: restore fp32 master weights from the checkpoint's fp32
            partitions (else from the model's low-precision weights, losing precision).
        ignore_unused_parameters: parameters that get no gradient in a backward are reduced as
            zeros; when False they are an error.
        use_multi_rank_bucket_allreduce: accepted for compatibility; reductions are always one
            collective per bucket here.
        stage3_prefetch_bucket_size: stage 3: elements of upcoming modules' parameters gathered
            ahead of use (0: no prefetch). Alias ``prefetch_bucket_size``.
        stage3_param_persistence_threshold: stage 3: parameters of at most this many elements
            stay whole on every rank and are never released. Alias
            ``param_persistence_threshold``.
        stage3_max_live_parameters: stage 3: most elements of gathered parameters held at once
            (prefetch stops short of it). Alias ``max_live_parameters``.
        stage3_max_reuse_distance: stage 3: a parameter used again within this many elements of
            other gathered parameters is not released after a module. Alias
            ``max_reuse_distance``.
        stage3_gather_16bit_weights_on_model_save: stage 3: gather whole 16-bit weights when the
            engine saves the model. Aliases ``gather_16bit_weights_on_model_save``,
            ``stage3_gather_fp16_weights_on_model_save``.
        sub_group_size: stage 3: elements of fp32 master weights per optimizer sub-group (whole
            parameters are grouped until it is exceeded).
        offload_param: stage 3: see :class:`OffloadParamConfig`.
        zero_quantized_weights: stage 3, ZeRO++ qwZ: the forward and backward all-gathers
            of parameters send int8 blockwise-quantized shards (see ``_zeropp.py``).
        zero_quantized_gradients: stage 3, ZeRO++ qgZ: gradients are reduced by an
            all-to-all of int8 blockwise-quantized rows instead of a reduce-scatter.
        zero_hpz_partition_size: stage 3, ZeRO++ hpZ: ranks per secondary partition (1: off);
            backward re-gathers parameters within groups of this many consecutive ranks.
        mics_shard_size: stage 3, MiCS: ranks per shard group (-1: off); parameters, gradients
            and optimizer state are sharded within groups of this many consecutive ranks and
            replicated across them (see ``_mics.py``).
        unimplemented: the keys of features ds does not implement, at DeepSpeed's defaults
            (the only values accepted): ``unimplemented["zenflow"]`` is None.
    """

    stage: int = 0
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = 500_000_000
    allgather_partitions: bool = True
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool | None = None
    round_robin_gradients: bool = False
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    elastic_checkpoint: bool = False
    load_from_fp32_weights: bool = True
    ignore_unused_parameters: bool = True
    use_multi_rank_bucket_allreduce: bool = True
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_param_persistence_threshold: int = 100_000
    stage3_max_live_parameters: int = 1_000_000_000
    stage3_max_reuse_distance: int = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: bool = False
    sub_group_size: int = 1_000_000_000
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    zero_quantized_weights: bool = False
    zero_quantized_gradients: bool = False
    zero_hpz_partition_size: int = 1
    mics_shard_size: int = -1
    unimplemented: Mapping[str, Any] = field(
        default_factory=lambda: {k: d for k, (d, _) in _REFUSED_WHEN_REQUESTED.items()},
        compare=False,
    )

    def __post_init__(self) -> None:
        stage = self.stage
        if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
            raise ConfigError(f"{_SECTION}.stage = {stage!r}: expected 0, 1, 2 or 3")
        for name in ("reduce_bucket_size", "allgather_bucket_size", "sub_group_size"):
            value = _count(f"{_SECTION}.{name}", getattr(self, name), minimum=1)
            object.__setattr__(self, name, value)
        hpz = _count(f"{_SECTION}.zero_hpz_partition_size", self.zero_hpz_partition_size, minimum=1)
        object.__setattr__(self, "zero_hpz_partition_size", hpz)
        for name in (
            "stage3_prefetch_bucket_size",
            "stage3_param_persistence_threshold",
            "stage3_max_live_parameters",
            "stage3_max_reuse_distance",
        ):
            value = _count(f"{_SECTION}.{name}", getattr(self, name), minimum=0)
            object.__setattr__(self, name, value)
        if self.overlap_comm is None:
            object.__setattr__(self, "overlap_comm", stage == 3)  # DeepSpeed's default
        for f in fields(self):
            if f.type in ("bool", "bool | None"):
                _bool(f"{_SECTION}.{f.name}", getattr(self, f.name))
        offload = self._offload_section("offload_optimizer", OffloadOptimizerConfig)
        if offload.enabled and stage == 0:
            raise ConfigError(
                f'{_SECTION}.offload_optimizer.device = "{offload.device}" needs stage 1 or 2 '
                "(or 3): ZeRO-Offload steps each rank's optimizer partition; set stage to 1 or 2"
            )
        param_offload = self._offload_section("offload_param", OffloadParamConfig)
        if param_offload.enabled and stage != 3:
            raise ConfigError(
                f'{_SECTION}.offload_param.device = "{param_offload.device}" is a ZeRO stage 3 '
                "feature (only stage 3 partitions parameters); set stage to 3 or remove "
                "offload_param"
            )
        self._check_zeropp()

    def _check_zeropp(self) -> None:
        """ZeRO++ (qwZ, qgZ, hpZ) and MiCS work on stage 3's partitioned parameters, as in
        DeepSpeed."""
        asked = {
            "zero_quantized_weights": self.zero_quantized_weights,
            "zero_quantized_gradients": self.zero_quantized_gradients,
            "zero_hpz_partition_size": self.zero_hpz_partition_size > 1,
        }
        mics = self.mics_shard_size
        if isinstance(mics, bool) or not isinstance(mics, int) or (mics < 1 and mics != -1):
            raise ConfigError(
                f"{_SECTION}.mics_shard_size = {mics!r}: expected -1 (off) or the number of "
                "ranks per shard group"
            )
        if mics > 0 and self.zero_hpz_partition_size > 1:
            raise ConfigError(
                f"{_SECTION}.mics_shard_size = {mics} and zero_hpz_partition_size = "
                f"{self.zero_hpz_partition_size}: MiCS and hpZ are two ways of keeping gathers "
                "within a node; set only one of them"
            )
        asked["mics_shard_size"] = mics > 0
        for key, on in asked.items():
            value = getattr(self, key)
            if on and self.stage != 3:
                raise ConfigError(
                    f"{_SECTION}.{key} = {value!r} is a feature of stage 3 (it changes how "
                    f"partitioned parameters and gradients travel), but stage is {self.stage}; "
                    f"set stage to 3 or remove {key}"
                )

    def _offload_section(self, key: str, kind: type[_OffloadTarget]) -> Any:
        """Coerce the ``key`` section (None or a mapping) to ``kind`` in place, or say why not."""
        section = getattr(self, key)
        if section is None or isinstance(section, Mapping):
            section = kind.from_dict(section)
            object.__setattr__(self, key, section)
        if not isinstance(section, kind):
            raise ConfigError(
                f'{_SECTION}.{key} = {section!r}: expected a mapping such as {{"device": "cpu"}}'
            )
        return section

    @property
    def offload_optimizer_if_enabled(self) -> OffloadOptimizerConfig | None:
        """``offload_optimizer`` when it offloads, else None (DeepSpeed's
        ``zero_offload_optimizer()``, which user code tests for truth)."""
        return self.offload_optimizer if self.offload_optimizer.enabled else None

    @property
    def offload_param_if_enabled(self) -> OffloadParamConfig | None:
        """``offload_param`` when it offloads, else None (``zero_offload_param()``)."""
        return self.offload_param if self.offload_param.enabled else None

    @property
    def shard_optimizer_state(self) -> bool:
        """Each rank keeps fp32 master weights and optimizer state only for its partition."""
        return self.stage >= 1

    @property
    def shard_gradients(self) -> bool:
        """Gradients are reduce-scattered during every backward; each rank keeps its shard."""
        return self.stage >= 2

    @property
    def shard_parameters(self) -> bool:
        """Parameters are stored as 1/N shards and gathered around each module (stage 3)."""
        return self.stage >= 3

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> ZeroConfig:
        """Build from the JSON ``zero_optimization`` section (see [Note: zero keys refused only
        when requested]). ``"auto"`` stands for a key's default, as in DeepSpeed's models.

        Example:
            >>> ZeroConfig.from_dict({"stage": 2, "overlap_comm": True}).shard_gradients
            True
        """
        section = _without_auto(section)
        own = {f.name for f in fields(cls)} - {"unimplemented"}
        known = own | set(_ALIASES) | set(_REFUSED_WHEN_REQUESTED) | set(_DEPRECATED)
        check_keys(_SECTION, section, known)
        given_as: dict[str, str] = {}
        for key, value in list(section.items()):
            if key in _ALIASES:
                given_as[_ALIASES[key]] = key
                name = _ALIASES[key]
                if name in section and section[name] != value:
                    raise ConfigError(
                        f"{_SECTION}.{key} = {value!r} is an alias of {name} = "
                        f"{section[name]!r}; give only one of them"
                    )
                section[name] = section.pop(key)
        _translate_deprecated(section)
        unimplemented = {}
        for key, (default, feature) in _REFUSED_WHEN_REQUESTED.items():
            value = section.pop(key, default)
            if not _is_default(value, default):
                raise ConfigError(
                    f"{_SECTION}.{given_as.get(key, key)} = {value!r} asks for {feature}, which "
                    "is not implemented "
                    f"in ds; remove it or leave it at DeepSpeed's default {default!r}"
                )
            unimplemented[key] = default
        return cls(**section, unimplemented=unimplemented)


def _without_auto(section: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of a section without its ``"auto"`` values (DeepSpeed's models drop them, so the
    key takes its default); nested offload sections too."""
    out: dict[str, Any] = {}
    for key, value in as_section(_SECTION, section).items():
        if is_auto(value):
            continue
        out[key] = _without_auto(value) if isinstance(value, Mapping) else value
    return out


def _translate_deprecated(section: dict[str, Any]) -> None:
    """DeepSpeed's deprecated ``cpu_offload*`` keys, written into the offload sections they
    stand for (true only; false and null mean nothing)."""
    for key, (targets, name, setting) in _DEPRECATED.items():
        if key not in section:
            continue
        value = section.pop(key)
        if value is None or not _bool(f"{_SECTION}.{key}", value):
            continue
        for target in targets:
            current = section.get(target)
            current = dict(current) if isinstance(current, Mapping) else {}
            if name in current and current[name] != setting:
                raise ConfigError(
                    f"{_SECTION}.{key} = true (deprecated) means {target}.{name} = {setting!r}, "
                    f"but {target}.{name} = {current[name]!r}; remove {key}"
                )
            if target == "offload_param" and name == "pin_memory" and not current:
                continue  # pin memory applies only to an offload section that exists
            current[name] = setting
            section[target] = current


def _is_default(value: Any, default: Any) -> bool:
    if isinstance(default, bool) or default is None:
        return value is default
    return not isinstance(value, bool) and value == default


class OffloadStateTypeEnum(str, enum.Enum):
    """The kinds of training state ``offload_states`` moves off the compute device (DeepSpeed's
    names; see ``_state_offload.py``)."""

    optim_states = "optim_states"  # the wrapped optimizer's state (Adam's moments)
    hp_params = "hp_params"  # the fp32 master partitions
    lp_params = "lp_params"  # the model's (low-precision) parameters or stage 3 shards
    lp_grads = "lp_grads"  # gradient buffers and partitions held between steps
    contiguous_grad_buffer = "contiguous_grad_buffer"  # reusable reduction staging buffers


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Bytes one rank holds for model states (see ``ZeroOptimizer.memory_breakdown``).

    Attributes:
        params: the model's parameters (low precision, full, incl. alignment padding).
        grads: gradients: the full flat buffer (stages 0/1) or this rank's shard (stage 2),
            plus the host fp32 gradient partition under offload.
        optimizer_state: fp32 master partition (unless it is the model's own fp32 storage)
            plus the optimizer's state tensors (Adam: exp_avg, exp_avg_sq).
        buffers: communication staging buffers allocated right now (not model state).
        host: the part of ``grads + optimizer_state`` placed in host memory by offload.
    """

    params: int
    grads: int
    optimizer_state: int
    buffers: int = 0
    host: int = 0

    @property
    def model_states(self) -> int:
        """``params + grads + optimizer_state``: what the ZeRO paper calls model states."""
        return self.params + self.grads + self.optimizer_state

    @property
    def total(self) -> int:
        """Model states plus communication buffers."""
        return self.model_states + self.buffers


@runtime_checkable
class TensorSwapper(Protocol):
    """Moves tensors to and from files on fast storage: ds-offload-aio's ``AsyncTensorSwapper``.

    ds-zero writes each optimizer-state tensor to its own file after a step and frees it, and
    before the next step allocates it again and reads it back. Paths are stable across steps
    and unique per rank.
    """

    def swap_out(
        self,
        tensors: Sequence[torch.Tensor],
        paths: Sequence[str | os.PathLike[str]],
        *,
        async_op: bool = False,
    ) -> None:
        """Write each tensor to its path; the tensors may be freed once this returns."""
        ...

    def swap_in(
        self,
        tensors: Sequence[torch.Tensor],
        paths: Sequence[str | os.PathLike[str]],
        *,
        async_op: bool = False,
    ) -> None:
        """Read each path into its tensor (with ``async_op``, complete after :meth:`wait`)."""
        ...

    def wait(self) -> Any:
        """Complete every transfer in flight."""
        ...
