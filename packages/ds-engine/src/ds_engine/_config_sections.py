"""The ``checkpoint``, ``data_types`` and ``activation_checkpointing`` sections.

Both are frozen keyword-only dataclasses with DeepSpeed's key names and defaults, built with
``from_dict``; ``"auto"`` stands for a key's default (DeepSpeed's config models drop it).
Settings ds does not implement inside them (a checkpoint ``writer``, pipelined parallel writes,
a gradient accumulation dtype) are refused only when they ask for something.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from ds_comm import ConfigError
from ds_comm.api import as_section, check_keys, is_auto, without_auto

__all__ = [
    "ActivationCheckpointingConfig",
    "CheckpointConfig",
    "DataTypesConfig",
    "dtype_from_name",
    "section_values",
]

_TAG_VALIDATION = ("IGNORE", "WARN", "FAIL")

# DeepSpeed's DtypeEnum spellings.
_DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "torch.float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "torch.bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
    "torch.float32": torch.float32,
}
_DTYPE_SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


def dtype_from_name(where: str, name: Any) -> torch.dtype | None:
    """A DeepSpeed dtype name (``"bf16"``, ``"float16"``, ``"fp32"``, ...) as a torch dtype."""
    if name is None:
        return None
    dtype = _DTYPE_NAMES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise ConfigError(f"{where} = {name!r}: expected one of {sorted(_DTYPE_NAMES)} or null")
    return dtype


def section_values(where: str, section: Any, cls: type) -> dict[str, Any]:
    """A section's keys checked against ``cls``'s fields (did-you-mean), "auto" dropped."""
    values = as_section(where, section)
    check_keys(where, values, (f.name for f in fields(cls)))
    return without_auto(values)


def _bool(where: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{where} = {value!r}: expected true or false")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """The ``checkpoint`` section.

    Attributes:
        tag_validation: ``"Ignore"``, ``"Warn"`` (default) or ``"Fail"``: what the engine does
            when ranks save under different tags. Stored upper-case, as DeepSpeed compares it.
        load_universal: ``load_checkpoint`` reads a universal folder (DeepSpeed's layout, from
            ``ds-to-universal``; the tag ``latest_universal`` names) at any world size / stage.
            ds's own checkpoints re-partition on load without it.
        use_node_local_storage: every node writes its own copy (local rank 0 saves the
            replicated files) instead of global rank 0 on shared storage.
        parallel_write: ``{"pipeline_stage": false}``; pipelined parallel writes are not
            implemented in ds (true is refused).
        checkpoint_serialization: torch's zip serialization (false: the legacy format) is not
            switchable in ds (false is refused).
        writer: a decoupled/fast checkpoint writer; not implemented in ds (must be null).
    """

    tag_validation: str = "WARN"
    load_universal: bool = False
    use_node_local_storage: bool = False
    parallel_write: Mapping[str, Any] | None = None
    checkpoint_serialization: bool = True
    writer: Any = None

    def __post_init__(self) -> None:
        mode = self.tag_validation
        if not isinstance(mode, str) or mode.upper() not in _TAG_VALIDATION:
            raise ConfigError(
                f"checkpoint.tag_validation = {mode!r}: expected one of Ignore, Warn or Fail"
            )
        object.__setattr__(self, "tag_validation", mode.upper())
        for name in ("load_universal", "use_node_local_storage", "checkpoint_serialization"):
            _bool(f"checkpoint.{name}", getattr(self, name))
        write = as_section("checkpoint.parallel_write", self.parallel_write)
        check_keys("checkpoint.parallel_write", write, ["pipeline_stage"])
        stage = write.get("pipeline_stage", False)
        _bool("checkpoint.parallel_write.pipeline_stage", stage)
        if stage:
            raise ConfigError(
                "checkpoint.parallel_write.pipeline_stage = true asks for pipelined parallel "
                "checkpoint writes, which are not implemented in ds; set it to false"
            )
        object.__setattr__(self, "parallel_write", {"pipeline_stage": False})
        if not self.checkpoint_serialization:
            raise ConfigError(
                "checkpoint.checkpoint_serialization = false asks for torch's legacy "
                "(non-zip) checkpoint format, which is not implemented in ds; set it to true"
            )
        if self.writer is not None:
            raise ConfigError(
                f"checkpoint.writer = {self.writer!r} asks for a decoupled/fast checkpoint "
                "writer, which is not implemented in ds; remove it (null)"
            )

    @property
    def tag_validation_enabled(self) -> bool:
        """DeepSpeed's ``checkpoint_tag_validation_enabled()``: mode is not Ignore."""
        return self.tag_validation != "IGNORE"

    @property
    def tag_validation_fail(self) -> bool:
        """DeepSpeed's ``checkpoint_tag_validation_fail()``: mode is Fail."""
        return self.tag_validation == "FAIL"

    @property
    def writer_enabled(self) -> bool:
        """DeepSpeed's ``checkpoint_writer_enabled()``: a writer is configured (never here)."""
        return self.writer is not None

    @property
    def parallel_write_pipeline(self) -> bool:
        """DeepSpeed's ``checkpoint_parallel_write_pipeline``: always False here."""
        return False

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> CheckpointConfig:
        """Build from the JSON ``checkpoint`` section (unknown keys: did-you-mean errors)."""
        return cls(**section_values("checkpoint", section, cls))


@dataclass(frozen=True, kw_only=True)
class DataTypesConfig:
    """The ``data_types`` section (DeepSpeed 0.19).

    Attributes:
        grad_accum_dtype: dtype gradients accumulate in; null (default) is the dtype ds
            accumulates in (see :meth:`check_grad_accum`). Naming that dtype is accepted; any
            other is not implemented in ds (refused).
        param_dtype: null, or the dtype the enabled fp16/bf16 mode implies (checked by
            :class:`ds_engine.DeepSpeedConfig`; a different one is an error, as in DeepSpeed).
        buffer_dtype: null keeps the model's buffers in their loaded dtype under fp16/bf16
            (DeepSpeed's behaviour); a dtype name casts them to it.
        keep_in_fp32_modules: ``"auto"`` (DeepSpeed's default) or a list of module-name patterns
            whose parameters and buffers stay fp32 under fp16/bf16.
    """

    grad_accum_dtype: str | None = None
    param_dtype: str | None = None
    buffer_dtype: str | None = None
    keep_in_fp32_modules: str | list[str] = "auto"

    def __post_init__(self) -> None:
        dtype_from_name("data_types.param_dtype", self.param_dtype)
        dtype_from_name("data_types.buffer_dtype", self.buffer_dtype)
        dtype_from_name("data_types.grad_accum_dtype", self.grad_accum_dtype)
        keep = self.keep_in_fp32_modules
        if keep != "auto":
            if not isinstance(keep, (list, tuple)) or not all(isinstance(n, str) for n in keep):
                raise ConfigError(
                    f'data_types.keep_in_fp32_modules = {keep!r}: expected "auto" or a list of '
                    "module-name patterns"
                )
            object.__setattr__(self, "keep_in_fp32_modules", list(keep))

    @property
    def param_torch_dtype(self) -> torch.dtype | None:
        """``param_dtype`` as a torch dtype (None: follows fp16/bf16)."""
        return dtype_from_name("data_types.param_dtype", self.param_dtype)

    def check_grad_accum(self, accumulates_in: torch.dtype, where: str) -> None:
        """Refuse a ``grad_accum_dtype`` other than ``accumulates_in``, the dtype ds
        accumulates gradients in for this config (``where`` says why, for the message)."""
        requested = dtype_from_name("data_types.grad_accum_dtype", self.grad_accum_dtype)
        if requested is None or requested == accumulates_in:
            return
        name = _DTYPE_SHORT.get(accumulates_in, str(accumulates_in))
        raise ConfigError(
            f"data_types.grad_accum_dtype = {self.grad_accum_dtype!r} asks for gradients "
            f"accumulated in another dtype than the one ds uses here ({name}: {where}), which "
            f'is not implemented in ds; remove it or set "{name}"'
        )

    @property
    def buffer_torch_dtype(self) -> torch.dtype | None:
        """``buffer_dtype`` as a torch dtype (None: buffers keep their dtype)."""
        return dtype_from_name("data_types.buffer_dtype", self.buffer_dtype)

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> DataTypesConfig:
        """Build from the JSON ``data_types`` section; "auto" keeps a key's default."""
        values = section_values("data_types", section, cls)
        if section is not None and is_auto(section.get("keep_in_fp32_modules")):
            values["keep_in_fp32_modules"] = "auto"
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointingConfig:
    """The ``activation_checkpointing`` section, read by ``deepspeed.checkpointing.configure``
    (``ds_engine.checkpointing``) as in DeepSpeed, whose engine does not act on it either.

    Attributes:
        partition_activations: split saved checkpoint inputs across the model-parallel group.
        contiguous_memory_optimization: copy partitioned activations into one buffer.
        cpu_checkpointing: keep saved checkpoint inputs in host memory.
        number_checkpoints: checkpoints per step, sizing the contiguous buffer (None: unknown).
        synchronize_checkpoint_boundary: synchronize the accelerator at each checkpoint.
        profile: time each checkpointed function's forward and backward.
    """

    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name != "number_checkpoints":
                _bool(f"activation_checkpointing.{f.name}", getattr(self, f.name))
        count = self.number_checkpoints
        if count is not None and (
            isinstance(count, bool) or not isinstance(count, int) or count < 1
        ):
            raise ConfigError(
                f"activation_checkpointing.number_checkpoints = {count!r}: expected a positive "
                "integer or null"
            )

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None) -> ActivationCheckpointingConfig:
        """Build from the JSON ``activation_checkpointing`` section."""
        return cls(**section_values("activation_checkpointing", section, cls))
