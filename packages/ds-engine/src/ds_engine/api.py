"""Public types of ds-engine: the whole DeepSpeed config, composed from each package's section.

[Note: one config, many owners]
Each section is parsed by the package that implements it (``ds_zero.ZeroConfig``,
``ds_optim.OptimizerConfig``/``SchedulerConfig``/``FP16Config``/``BF16Config``,
``ds_comm.CommsLoggerConfig``); this module owns only the top-level keys (batch sizes,
clipping, logging) and the batch-size triad, which needs the data-parallel world size. Unknown
top-level keys are errors with the closest known key (DeepSpeed silently ignores them).

The ``aio`` section belongs to ds-offload-aio, an optional dependency (extra ``nvme``): it is
parsed into ``ds_offload_aio.AioConfig`` when that package is installed and kept as the plain
mapping otherwise; ``offload_optimizer.device = "nvme"`` without it is an ImportError naming
``pip install ds-offload-aio``.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from ds_comm import CommsLoggerConfig, ConfigError
from ds_engine._optional import require
from ds_optim import BF16Config, FP16Config, OptimizerConfig, SchedulerConfig
from ds_zero import ZeroConfig

__all__ = ["ConfigError", "DeepSpeedConfig", "config_json_schema", "load_config_dict"]

_SECTIONS: dict[str, Any] = {
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "fp16": FP16Config,
    "bf16": BF16Config,
    "zero_optimization": ZeroConfig,
    "comms_logger": CommsLoggerConfig,
}
# DeepSpeed accepts "bfloat16" as an alias of "bf16".
_ALIASES = {"bfloat16": "bf16"}
_COMM_DTYPES = (None, "fp32", "fp16", "bf16")


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key} = {value!r}: expected true or false")
    return value


def _positive_int(key: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{key} = {value!r}: expected a positive integer")
    return value


def _number(key: str, value: Any, *, minimum: float) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < minimum:
        raise ConfigError(f"{key} = {value!r}: expected a finite number >= {minimum}")
    return float(value)


@dataclass(frozen=True, kw_only=True)
class DeepSpeedConfig:
    """The whole DeepSpeed JSON config, resolved for a data-parallel world size.

    Build it with :meth:`from_dict`; the batch-size triad is complete afterwards.

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
        gradient_clipping: max global L2 norm of gradients (0 disables; DeepSpeed's default 1.0).
        steps_per_print: print a progress line every this many optimizer steps.
        wall_clock_breakdown: time forward, backward and step and print them.
        prescale_gradients: divide gradients by the data-parallel size before the reduction
            (``gradient_predivide_factor`` is then ignored, as in DeepSpeed).
        gradient_predivide_factor: without ``prescale_gradients``, gradients are divided by
            it before the reduction and the sum multiplied by ``factor / dp_world_size`` after.
        communication_data_type: ``fp32``, ``fp16`` or ``bf16``: the dtype gradient reductions
            run in (None: the gradients' dtype).
        zero_allow_untested_optimizer: accepted for compatibility (any elementwise optimizer
            works with ds-zero).
        memory_breakdown: print :meth:`DeepSpeedEngine.memory_breakdown` with progress lines.
        seed: seeds torch, random and the data loader's shuffling when set.
        aio: the ``aio`` section (``ds_offload_aio.AioConfig``; None: absent, DeepSpeed's
            defaults apply) used by ``offload_optimizer.device = "nvme"``.
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
    gradient_clipping: float = 1.0
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    communication_data_type: str | None = None
    zero_allow_untested_optimizer: bool = False
    memory_breakdown: bool = False
    seed: int | None = None
    aio: Any = None

    def __post_init__(self) -> None:
        for name in ("wall_clock_breakdown", "prescale_gradients", "memory_breakdown"):
            _bool(name, getattr(self, name))
        _bool("zero_allow_untested_optimizer", self.zero_allow_untested_optimizer)
        clip = _number("gradient_clipping", self.gradient_clipping, minimum=0.0)
        object.__setattr__(self, "gradient_clipping", clip)
        _positive_int("steps_per_print", self.steps_per_print)
        factor = _number("gradient_predivide_factor", self.gradient_predivide_factor, minimum=0)
        if factor == 0:
            raise ConfigError(
                "gradient_predivide_factor = 0: gradients are divided by it; use a number > 0 "
                "(1.0, the default, divides by the data-parallel size after the reduction)"
            )
        object.__setattr__(self, "gradient_predivide_factor", factor)
        if self.communication_data_type not in _COMM_DTYPES:
            raise ConfigError(
                f"communication_data_type = {self.communication_data_type!r}: expected one of "
                f"{list(_COMM_DTYPES)}"
            )
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError(
                "fp16.enabled = true and bf16.enabled = true: choose one mixed-precision mode"
            )
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ConfigError(f"seed = {self.seed!r}: expected an integer")
        _check_triad(
            self.train_batch_size,
            self.train_micro_batch_size_per_gpu,
            self.gradient_accumulation_steps,
            self.dp_world_size,
        )
        if self.zero_optimization.offload_optimizer.device == "nvme":
            aio = require(
                "ds_offload_aio",
                "ds-offload-aio",
                'zero_optimization.offload_optimizer.device = "nvme" (NVMe offload)',
            )
            if not isinstance(self.aio, aio.AioConfig):
                object.__setattr__(self, "aio", aio.AioConfig.from_dict(self.aio))

    @property
    def param_dtype_name(self) -> str:
        """``fp16``, ``bf16`` or ``fp32``: the dtype the engine gives the model's weights."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], *, dp_world_size: int = 1) -> DeepSpeedConfig:
        """Parse a DeepSpeed JSON config (as a dict) for ``dp_world_size`` data-parallel ranks.

        Any two of the batch-size triad give the third; a legacy ``"zero_optimization": true``
        means stage 1.

        Raises:
            ConfigError: an unknown key (with the closest known one), a bad value (naming the
                key path and value) or an inconsistent batch-size triad.

        Example:
            >>> cfg = DeepSpeedConfig.from_dict({"train_batch_size": 32}, dp_world_size=2)
            >>> cfg.train_micro_batch_size_per_gpu
            16
        """
        if not isinstance(config, Mapping):
            raise ConfigError(f"config = {config!r}: expected a JSON object (a mapping)")
        values = {_ALIASES.get(k, k): v for k, v in config.items()}
        known = sorted({f.name for f in fields(cls)} - {"dp_world_size"} | set(_ALIASES))
        for key in values:
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"known keys: {known}"
                raise ConfigError(f"{key} is not a known config key; {hint}")
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
        train, micro, gas = _complete_triad(
            _positive_int("train_batch_size", values.pop("train_batch_size", None)),
            _positive_int(
                "train_micro_batch_size_per_gpu", values.pop("train_micro_batch_size_per_gpu", None)
            ),
            _positive_int(
                "gradient_accumulation_steps", values.pop("gradient_accumulation_steps", None)
            ),
            dp_world_size,
        )
        return cls(
            train_batch_size=train,
            train_micro_batch_size_per_gpu=micro,
            gradient_accumulation_steps=gas,
            dp_world_size=dp_world_size,
            **values,
        )


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


def _equation(train: int, micro: int, gas: int, world: int) -> str:
    return (
        f"train_batch_size ({train}) must equal train_micro_batch_size_per_gpu ({micro}) x "
        f"gradient_accumulation_steps ({gas}) x data-parallel size ({world}) = "
        f"{micro * gas * world}"
    )


def _check_triad(train: int, micro: int, gas: int, world: int) -> None:
    if train != micro * gas * world:
        raise ConfigError(_equation(train, micro, gas, world))


def _divide(train: int, by: int, what: str, world: int) -> int:
    if train % by:
        raise ConfigError(
            f"train_batch_size = {train} is not divisible by {what} = {by} (data-parallel size "
            f"{world}); change train_batch_size or the other batch keys"
        )
    return train // by


def _complete_triad(
    train: int | None, micro: int | None, gas: int | None, world: int
) -> tuple[int, int, int]:
    """DeepSpeed's rules: any two give the third; one of train/micro alone means gas = 1."""
    if train is not None and micro is not None and gas is not None:
        _check_triad(train, micro, gas, world)
        return train, micro, gas
    if train is not None and micro is not None:
        gas = _divide(train, micro * world, "micro batch x data-parallel size", world)
    elif train is not None and gas is not None:
        micro = _divide(
            train, gas * world, "gradient_accumulation_steps x data-parallel size", world
        )
    elif micro is not None:
        gas = gas or 1
        train = micro * gas * world
    elif train is not None:
        gas = 1
        micro = _divide(train, world, "the data-parallel size", world)
    else:
        raise ConfigError(
            "train_batch_size and train_micro_batch_size_per_gpu are both missing: set at least "
            'one, e.g. "train_micro_batch_size_per_gpu": 8'
        )
    if micro < 1 or gas < 1:  # a quotient of 0
        _check_triad(train, micro, gas, world)
    return train, micro, gas


def load_config_dict(config: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """A config as a dict: a mapping is copied, a path is read as JSON."""
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    if not path.is_file():
        raise ConfigError(f"config = {str(config)!r}: no such JSON file")
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(path)!r}: expected a JSON object at the top level")
    return loaded


# --- JSON schema ---------------------------------------------------------------------------------

_JSON_TYPES = {"bool": "boolean", "int": "integer", "float": "number", "str": "string"}


def _field_schema(annotation: str, default: Any) -> dict[str, Any]:
    parts = [p.strip() for p in str(annotation).split("|")]
    types = sorted({_JSON_TYPES[p] for p in parts if p in _JSON_TYPES})
    if "float" in parts and "integer" not in types:
        types.append("integer")
    if "None" in parts:
        types.append("null")
    if not types:
        return {}
    schema: dict[str, Any] = {"type": types[0] if len(types) == 1 else types}
    if default is not MISSING and isinstance(default, (bool, int, float, str, type(None))):
        schema["default"] = default
    return schema


def _dataclass_schema(cls: Any) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    for f in fields(cls):
        nested = f.default_factory if f.default_factory is not MISSING else None
        if nested is not None and is_dataclass(nested):
            properties[f.name] = _dataclass_schema(nested)
        elif f.name in ("type", "params"):
            kind = "string" if f.name == "type" else "object"
            properties[f.name] = {"type": kind}
        else:
            properties[f.name] = _field_schema(f.type, f.default)
    return {"type": "object", "properties": properties, "additionalProperties": False}


def config_json_schema() -> dict[str, Any]:
    """A JSON schema (draft 2020-12) of the config file, for editors' completion and checks.

    Sections with open-ended contents (``optimizer.params``, ``scheduler.params``) are objects;
    their names are checked when the config is parsed.

    Example:
        >>> Path("ds_config.schema.json").write_text(json.dumps(config_json_schema(), indent=1))
    """
    schema = _dataclass_schema(DeepSpeedConfig)
    del schema["properties"]["dp_world_size"]
    for name, section_cls in _SECTIONS.items():
        schema["properties"][name] = _dataclass_schema(section_cls)
    zero = schema["properties"]["zero_optimization"]
    schema["properties"]["zero_optimization"] = {"anyOf": [zero, {"type": "boolean"}]}
    schema["properties"]["bfloat16"] = schema["properties"]["bf16"]
    try:
        from ds_offload_aio import AioConfig
    except ModuleNotFoundError:
        schema["properties"]["aio"] = {"type": "object"}
    else:
        schema["properties"]["aio"] = _dataclass_schema(AioConfig)
    schema["properties"]["train_batch_size"] = {"type": "integer", "minimum": 1}
    schema["properties"]["train_micro_batch_size_per_gpu"] = {"type": "integer", "minimum": 1}
    schema["properties"]["gradient_accumulation_steps"] = {"type": "integer", "minimum": 1}
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "ds / DeepSpeed config"
    return schema
