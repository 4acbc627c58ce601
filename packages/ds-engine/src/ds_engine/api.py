"""Public types of ds-engine: the whole DeepSpeed config, composed from each package's section.

[Note: one config, many owners]
Each section is parsed by the package that implements it (``ds_zero.ZeroConfig``,
``ds_optim.OptimizerConfig``/``SchedulerConfig``/``FP16Config``/``BF16Config``,
``ds_comm.CommsLoggerConfig``); this module owns the top-level keys (batch sizes, clipping,
logging, ``checkpoint``, ``data_types``) and the batch-size triad, which needs the data-parallel
world size. Keys for DeepSpeed features ds does not implement are one table
(``_config_features.NOT_IMPLEMENTED``), accepted while they ask for nothing and refused when
they ask for the feature (see [Note: refused only when requested]). Unknown top-level keys are
errors with the closest known key (DeepSpeed silently ignores them).

``"auto"`` (the placeholder Hugging Face transformers and accelerate write, then resolve) stands
for DeepSpeed's default wherever a value has one: every section key, ``gradient_clipping``,
``steps_per_print``; a batch key left ``"auto"`` counts as not given. ``optimizer.params`` and
``scheduler.params`` keep it until the optimizer is built (``OptimizerConfig.resolved_params``).

A parsed config is also a read-only mapping over the user's dict, as DeepSpeed's
``engine.config`` is: ``cfg.zero_optimization.stage`` and ``cfg.get("zero_optimization")`` both
work.

The ``aio`` section belongs to ds-offload-aio, an optional dependency (extra ``nvme``): it is
parsed into ``ds_offload_aio.AioConfig`` when that package is installed and kept as the plain
mapping otherwise; ``offload_optimizer.device = "nvme"`` without it is an ImportError naming
``pip install ds-offload-aio``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ds_comm import CommsLoggerConfig, ConfigError
from ds_comm.api import check_keys, is_auto
from ds_engine._config_data_efficiency import (
    CurriculumLegacyConfig,
    DataEfficiencyConfig,
    ProgressiveLayerDropConfig,
)
from ds_engine._config_features import NOT_IMPLEMENTED, FeatureSettings
from ds_engine._config_load import load_config_dict
from ds_engine._config_monitor import (
    CometConfig,
    CsvMonitorConfig,
    MonitorConfig,
    TensorBoardConfig,
    WandbConfig,
)
from ds_engine._config_sections import (
    ActivationCheckpointingConfig,
    CheckpointConfig,
    DataTypesConfig,
)
from ds_engine._config_triad import batch_key, check_triad, complete_triad
from ds_engine._flops_config import FlopsProfilerConfig
from ds_engine._optional import require
from ds_engine._sequence_parallel import check_sequence_parallel_size
from ds_engine._timers_config import TimersConfig
from ds_optim import BF16Config, FP16Config, OptimizerConfig, SchedulerConfig
from ds_zero import ZeroConfig

__all__ = [
    "ActivationCheckpointingConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataTypesConfig",
    "DeepSpeedConfig",
    "config_json_schema",
    "load_config_dict",
]

_SECTIONS: dict[str, Any] = {
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "fp16": FP16Config,
    "bf16": BF16Config,
    "zero_optimization": ZeroConfig,
    "comms_logger": CommsLoggerConfig,
    "checkpoint": CheckpointConfig,
    "data_types": DataTypesConfig,
    "activation_checkpointing": ActivationCheckpointingConfig,
    "tensorboard": TensorBoardConfig,
    "wandb": WandbConfig,
    "csv_monitor": CsvMonitorConfig,
    "comet": CometConfig,
    "curriculum_learning": CurriculumLegacyConfig,
    "progressive_layer_drop": ProgressiveLayerDropConfig,
    "data_efficiency": DataEfficiencyConfig,
    "flops_profiler": FlopsProfilerConfig,
    "timers": TimersConfig,
}
# DeepSpeed accepts "bfloat16" as an alias of "bf16".
_ALIASES = {"bfloat16": "bf16"}
_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_COMM_DTYPES = (None, "fp32", "fp16", "bf16")
_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_INTERNAL = ("dp_world_size", "unimplemented", "user_config")


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key} = {value!r}: expected true or false")
    return value


def _number(key: str, value: Any, *, minimum: float) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < minimum:
        raise ConfigError(f"{key} = {value!r}: expected a finite number >= {minimum}")
    return float(value)


def _steps_per_print(value: Any) -> int | float:
    """A positive integer, or infinity (never print: what accelerate always sets; ``null``,
    DeepSpeed 0.19's own default, means the same)."""
    if value is None:
        return math.inf
    if isinstance(value, float) and math.isinf(value) and value > 0:
        return value
    if isinstance(value, float) and value.is_integer() and value >= 1:
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"steps_per_print = {value!r}: expected a positive integer, or Infinity to never print"
        )
    return value


@dataclass(frozen=True, kw_only=True)
class DeepSpeedConfig(Mapping[str, Any]):
    """The whole DeepSpeed JSON config, resolved for a data-parallel world size.

    Build it with :meth:`from_dict`; the batch-size triad is complete afterwards. It is also a
    read-only mapping over the user's config dict (``cfg["fp16"]``, ``cfg.get(...)``, ``in``,
    iteration), as DeepSpeed's ``engine.config`` is.

    Attributes:
        train_batch_size: samples per optimizer step over all data-parallel ranks.
        train_micro_batch_size_per_gpu: samples per forward/backward on one rank.
        gradient_accumulation_steps: micro-batches per optimizer step.
        dp_world_size: the data-parallel world size the triad was resolved for.
        optimizer: the ``optimizer`` section (None: the client passes an optimizer).
        scheduler: the ``scheduler`` section (None: constant LR or a client scheduler).
        fp16: the ``fp16`` section (fp16 weights, fp32 masters, loss scaling).
        bf16: the ``bf16`` section (bf16 weights, fp32 masters).
        zero_optimization: the ZeRO section (stage 0 is plain data parallelism).
        comms_logger: the ``comms_logger`` section.
        checkpoint: the ``checkpoint`` section (tag validation, node-local storage).
        data_types: the ``data_types`` section (buffer dtype, fp32-kept modules).
        activation_checkpointing: the section ``deepspeed.checkpointing.configure`` reads.
        tensorboard, wandb, csv_monitor, comet: the monitor sections (``engine.monitor``).
        curriculum_learning, progressive_layer_drop, data_efficiency: curriculum learning
            (legacy and data-sampling), progressive layer drop (docs/data_efficiency.md).
        flops_profiler: the ``flops_profiler`` section (``engine.flops_profiler``).
        timers: the ``timers`` section (the throughput figure of the progress line).
        gradient_clipping: max global L2 norm of gradients (0 disables; DeepSpeed's default 1.0).
        steps_per_print: print a progress line every this many optimizer steps (``inf``: never).
        wall_clock_breakdown: time forward, backward (autograd, reductions), step and the
            optimizer's phases and print them with DeepSpeed's names (docs/profiling.md).
        prescale_gradients: divide gradients by the data-parallel size before the reduction
            (``gradient_predivide_factor`` is then ignored, as in DeepSpeed).
        gradient_predivide_factor: without ``prescale_gradients``, gradients are divided by
            it before the reduction and the sum multiplied by ``factor / dp_world_size`` after.
        communication_data_type: ``fp32``, ``fp16`` or ``bf16``: the dtype gradient reductions
            run in (None: the gradients' dtype).
        zero_allow_untested_optimizer: accepted for compatibility (any elementwise optimizer
            works with ds-zero).
        zero_force_ds_cpu_optimizer: with ZeRO-Offload, require ds's CPU optimizer (a client
            optimizer is an error), DeepSpeed's default True.
        memory_breakdown: print :meth:`DeepSpeedEngine.memory_breakdown` with progress lines.
        dataloader_drop_last: ``deepspeed_io`` loaders drop the last incomplete batch.
        dump_state: print the engine's resolved configuration at start-up.
        log_level: the ds logger's level (``"info"``, ...; None leaves it as it is).
        seed: the shuffle seed of ``deepspeed_io`` loaders, the same on every rank (None: 0).
            It seeds nothing else: DeepSpeed's engine reads no top-level ``seed``; seed torch
            and ``random`` with ``deepspeed.runtime.utils.set_random_seed``.
        sequence_parallel_size: ranks each sequence is split over (Ulysses; 1: none); the
            data-parallel size is the world over it (docs/sequence_parallel.md).
        aio: the ``aio`` section (``ds_offload_aio.AioConfig``; None: absent, DeepSpeed's
            defaults apply) used by ``offload_optimizer.device = "nvme"``.
        unimplemented: every key of a feature ds does not implement, at its accepted (inert)
            value merged over DeepSpeed's defaults: ``unimplemented.flops_profiler.enabled``.
        user_config: the user's config dict, as given (what the mapping interface reads).
    """

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    dp_world_size: int = 1
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    comms_logger: CommsLoggerConfig = field(default_factory=CommsLoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    data_types: DataTypesConfig = field(default_factory=DataTypesConfig)
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig
    )
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    csv_monitor: CsvMonitorConfig = field(default_factory=CsvMonitorConfig)
    comet: CometConfig = field(default_factory=CometConfig)
    curriculum_learning: CurriculumLegacyConfig = field(default_factory=CurriculumLegacyConfig)
    progressive_layer_drop: ProgressiveLayerDropConfig = field(
        default_factory=ProgressiveLayerDropConfig
    )
    data_efficiency: DataEfficiencyConfig = field(default_factory=DataEfficiencyConfig)
    flops_profiler: FlopsProfilerConfig = field(default_factory=FlopsProfilerConfig)
    timers: TimersConfig = field(default_factory=TimersConfig)
    gradient_clipping: float = 1.0
    steps_per_print: int | float = 10
    wall_clock_breakdown: bool = False
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    communication_data_type: str | None = None
    zero_allow_untested_optimizer: bool = False
    zero_force_ds_cpu_optimizer: bool = True
    memory_breakdown: bool = False
    dataloader_drop_last: bool = False
    dump_state: bool = False
    log_level: str | None = None
    seed: int | None = None
    sequence_parallel_size: int = 1
    aio: Any = None
    unimplemented: FeatureSettings = field(default_factory=FeatureSettings, compare=False)
    user_config: Mapping[str, Any] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in (
            "wall_clock_breakdown",
            "prescale_gradients",
            "memory_breakdown",
            "zero_allow_untested_optimizer",
            "zero_force_ds_cpu_optimizer",
            "dataloader_drop_last",
            "dump_state",
        ):
            _bool(name, getattr(self, name))
        clip = _number("gradient_clipping", self.gradient_clipping, minimum=0.0)
        object.__setattr__(self, "gradient_clipping", clip)
        object.__setattr__(self, "steps_per_print", _steps_per_print(self.steps_per_print))
        factor = _number("gradient_predivide_factor", self.gradient_predivide_factor, minimum=0)
        if factor == 0:
            raise ConfigError(
                "gradient_predivide_factor = 0: gradients are divided by it; use a number > 0 "
                "(1.0, the default, divides by the data-parallel size after the reduction)"
            )
        object.__setattr__(self, "gradient_predivide_factor", factor)
        self._check_names()
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError(
                "fp16.enabled = true and bf16.enabled = true: choose one mixed-precision mode"
            )
        self._check_param_dtype()
        sp = check_sequence_parallel_size(self.sequence_parallel_size)
        object.__setattr__(self, "sequence_parallel_size", sp)
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ConfigError(f"seed = {self.seed!r}: expected an integer")
        check_triad(
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
            self.dp_world_size,
        )
        if self.user_config is None:
            triad = {k: getattr(self, k) for k in _BATCH_KEYS}
            object.__setattr__(self, "user_config", triad)
        self._check_grad_accum()
        if self.zero_optimization.offload_optimizer.device == "nvme":
            aio = require(
                "ds_offload_aio",
                "ds-offload-aio",
                'zero_optimization.offload_optimizer.device = "nvme" (NVMe offload)',
            )
            if not isinstance(self.aio, aio.AioConfig):
                object.__setattr__(self, "aio", aio.AioConfig.from_dict(self.aio))

    def _check_names(self) -> None:
        """``communication_data_type`` and ``log_level`` against their allowed names."""
        comm = self.communication_data_type
        if isinstance(comm, str):
            comm = comm.lower()
            object.__setattr__(self, "communication_data_type", comm)
        if comm not in _COMM_DTYPES:
            raise ConfigError(
                f"communication_data_type = {self.communication_data_type!r}: expected one of "
                f"{list(_COMM_DTYPES)}"
            )
        level = self.log_level
        if level is not None and (not isinstance(level, str) or level.lower() not in _LOG_LEVELS):
            raise ConfigError(f"log_level = {level!r}: expected one of {list(_LOG_LEVELS)}")
        if level is not None:
            object.__setattr__(self, "log_level", level.lower())

    def _check_grad_accum(self) -> None:
        """``data_types.grad_accum_dtype`` must name the dtype ds accumulates gradients in.

        Stage 3 accumulates into fp32 gradient shards, as does stage 2 under optimizer offload
        (into the fp32 host partition); stages 0-1 and stage 2 on the device accumulate in the
        model's dtype (see ds_zero's [Note: where gradients live])."""
        zero = self.zero_optimization
        if zero.stage == 3:
            where = "ZeRO stage 3 accumulates into fp32 gradient shards"
            self.data_types.check_grad_accum(torch.float32, where)
        elif zero.stage == 2 and zero.offload_optimizer.enabled:
            where = "ZeRO stage 2 with offload_optimizer accumulates into the fp32 host partition"
            self.data_types.check_grad_accum(torch.float32, where)
        else:
            where = f"ZeRO stage {zero.stage} accumulates in the model's dtype"
            self.data_types.check_grad_accum(self.model_dtype, where)

    def _check_param_dtype(self) -> None:
        """``data_types.param_dtype`` must be the dtype fp16/bf16 imply (DeepSpeed's check)."""
        requested = self.data_types.param_torch_dtype
        if requested is not None and requested != self.model_dtype:
            raise ConfigError(
                f"data_types.param_dtype = {self.data_types.param_dtype!r} conflicts with the "
                f"mixed-precision mode ({self.param_dtype_name}); set the fp16/bf16 'enabled' "
                "flag to match or remove data_types.param_dtype"
            )

    # --- the mapping over the user's dict (DeepSpeed's engine.config) ---------------------------

    def __getitem__(self, key: str) -> Any:
        assert self.user_config is not None
        return self.user_config[key]

    def __iter__(self) -> Iterator[str]:
        assert self.user_config is not None
        return iter(self.user_config)

    def __len__(self) -> int:
        assert self.user_config is not None
        return len(self.user_config)

    # --- derived values ---------------------------------------------------------------------

    @property
    def monitor_config(self) -> MonitorConfig:
        """DeepSpeed's ``monitor_config``: the four monitor sections and whether any is on."""
        return MonitorConfig(self.tensorboard, self.wandb, self.csv_monitor, self.comet)

    @property
    def param_dtype_name(self) -> str:
        """``fp16``, ``bf16`` or ``fp32``: the dtype the engine gives the model's weights."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    @property
    def postscale_gradients(self) -> bool:
        """DeepSpeed's ``postscale_gradients()``: gradients are scaled after the reduction."""
        return not self.prescale_gradients

    @property
    def model_dtype(self) -> torch.dtype:
        """The torch dtype the engine gives the model's weights."""
        return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(
            self.param_dtype_name, torch.float32
        )

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], *, dp_world_size: int = 1) -> DeepSpeedConfig:
        """Parse a DeepSpeed JSON config (as a dict) for ``dp_world_size`` data-parallel ranks.

        Any two of the batch-size triad give the third; a legacy ``"zero_optimization": true``
        means stage 1.

        Raises:
            ConfigError: an unknown key (with the closest known one), a bad value (naming the
                key path and value), a feature ds does not implement asked for, or an
                inconsistent batch-size triad.

        Example:
            >>> cfg = DeepSpeedConfig.from_dict({"train_batch_size": 32}, dp_world_size=2)
            >>> cfg.train_micro_batch_size_per_gpu, cfg.get("train_batch_size")
            (16, 32)
        """
        if not isinstance(config, Mapping):
            raise ConfigError(f"config = {config!r}: expected a JSON object (a mapping)")
        user = copy.deepcopy(dict(config))
        values = _canonical_keys(config)
        features = FeatureSettings({k: values.pop(k) for k in list(values) if k in NOT_IMPLEMENTED})
        for key in list(values):
            if key not in _SECTIONS and key not in _BATCH_KEYS and is_auto(values[key]):
                del values[key]  # "auto" left unresolved: DeepSpeed's default
        zero = values.get("zero_optimization")
        if isinstance(zero, bool):  # DeepSpeed's legacy form: true means stage 1
            values["zero_optimization"] = {"stage": 1 if zero else 0}
        for name, section_cls in _SECTIONS.items():
            if name in values:
                section = values[name]
                if section is not None and not isinstance(section, Mapping):
                    raise ConfigError(f"{name} = {section!r}: expected a JSON object")
                optional = name in ("optimizer", "scheduler")
                values[name] = (
                    None if optional and section is None else section_cls.from_dict(section)
                )
        if "aio" in values:
            values["aio"] = _aio_section(values["aio"])
        given_train, given_micro, given_gas = (
            batch_key(k, values.pop(k, None)) for k in _BATCH_KEYS
        )
        train, micro, gas = complete_triad(given_train, given_micro, given_gas, dp_world_size)
        return cls(
            train_batch_size=train,
            train_micro_batch_size_per_gpu=micro,
            gradient_accumulation_steps=gas,
            dp_world_size=dp_world_size,
            unimplemented=features,
            user_config=user,
            **values,
        )


def refuse_unimplemented(config: Mapping[str, Any]) -> None:
    """Refuse the config's unknown keys and unimplemented features before anything is built
    from it (``initialize`` builds process grids from ``tensor_parallel`` and
    ``sequence_parallel_size``: a refusal must come first, not a world-size error about a
    setting that would be refused anyway). ``DeepSpeedConfig.from_dict`` checks the rest."""
    values = _canonical_keys(config)
    FeatureSettings({k: values[k] for k in values if k in NOT_IMPLEMENTED})


def _canonical_keys(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config's keys with aliases resolved; an unknown key is a did-you-mean error."""
    known_fields = {f.name for f in fields(DeepSpeedConfig)} - set(_INTERNAL)
    check_keys(
        "", config, known_fields | set(_ALIASES) | set(NOT_IMPLEMENTED), what="a known config key"
    )
    values: dict[str, Any] = {}
    for key, value in config.items():
        name = _ALIASES.get(key, key)
        if name in values:
            raise ConfigError(f"{key} and {name} are the same section; give only one of them")
        values[name] = value
    return values


def _aio_section(section: Any) -> Any:
    """The ``aio`` section parsed by ds-offload-aio, or the mapping itself without it."""
    if section is not None and not isinstance(section, Mapping):
        raise ConfigError(f"aio = {section!r}: expected a JSON object")
    try:
        import ds_offload_aio
    except ModuleNotFoundError as exc:
        if exc.name != "ds_offload_aio":
            raise
        return None if section is None else dict(section)
    return ds_offload_aio.AioConfig.from_dict(section)


def config_json_schema() -> dict[str, Any]:
    """A JSON schema (draft 2020-12) of the config file, for editors' completion and checks.

    Example:
        >>> Path("ds_config.schema.json").write_text(json.dumps(config_json_schema(), indent=1))
    """
    from ds_engine._config_schema import build_schema

    return build_schema(DeepSpeedConfig, _SECTIONS)
