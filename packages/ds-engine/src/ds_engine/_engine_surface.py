"""DeepSpeedEngine's public surface beyond the training loop: ranks and sizes, batch-size
changes, derived config accessors, state dicts, compile and teardown.

The config accessors are generated (see [Note: one mechanism for the accessors] in
``_accessors.py``), derived values included (they are properties of the config models); what is
here reads optional sections, runtime state or the model. The host class (``DeepSpeedEngine``) sets
``_config``, ``module``, ``optimizer``, ``basic_optimizer``, ``client_optimizer``,
``lr_scheduler``, ``mpu``, ``dp_world_size``, ``timers`` and ``global_rank``.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from typing import Any, cast

import torch

import ds_comm
import ds_zero
from ds_comm.accelerator import get_accelerator
from ds_engine._moe_consolidate import whole_state_dict
from ds_zero import GatheredParameters, OffloadStateTypeEnum

__all__ = ["EngineSurface", "replace_config"]

logger = logging.getLogger("DeepSpeed")


def replace_config(config: Any, **changes: Any) -> Any:
    """A copy of the (frozen) parsed config with ``changes``, validated again."""
    if dataclasses.is_dataclass(config):
        return dataclasses.replace(config, **changes)  # type: ignore[type-var]
    return type(config).model_validate({**config.model_dump(), **changes})


def _is_partitioned(p: torch.Tensor) -> bool:
    return hasattr(p, "ds_id")


class EngineSurface:
    """DeepSpeed's engine methods that are not the loop itself (mixed into the engine)."""

    _config: Any
    module: torch.nn.Module
    optimizer: Any
    basic_optimizer: Any
    client_optimizer: Any
    lr_scheduler: Any
    mpu: Any
    dp_world_size: int
    global_rank: int
    timers: Any
    monitor: Any

    # --- ranks and groups ----------------------------------------------------------------------

    def get_data_parallel_rank(self) -> int:
        """This rank's index in its data-parallel group."""
        return self.dp_rank  # type: ignore[attr-defined]

    def get_model_parallel_rank(self) -> int:
        """This rank's index in its model-parallel group (0 without an mpu)."""
        return self.mpu.get_model_parallel_rank() if self.mpu is not None else 0

    def get_tensor_parallel_rank(self) -> int:
        """This rank's tensor-parallel index (the mpu's model-parallel one; 0 without an mpu)."""
        if self.mpu is None:
            return 0
        for name in ("get_tensor_model_parallel_rank", "get_model_parallel_rank"):
            if hasattr(self.mpu, name):
                return int(getattr(self.mpu, name)())
        return 0

    def get_sequence_parallel_group(self) -> Any:
        """The sequence-parallel group: the mpu's when it has one; None (no sequence
        parallelism) otherwise."""
        if self.mpu is not None and hasattr(self.mpu, "get_sequence_parallel_group"):
            return self.mpu.get_sequence_parallel_group()
        return None

    # --- batch size ----------------------------------------------------------------------------

    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``."""
        config = self._config
        return (
            config.train_batch_size,
            config.train_micro_batch_size_per_gpu,
            config.gradient_accumulation_steps,
        )

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch size by changing the accumulation steps (the micro-batch size
        stays), as DeepSpeed does; takes effect from the next accumulation window.

        Raises:
            ValueError: ``train_batch_size`` is not a multiple of micro-batch x data-parallel size.

        Example:
            >>> engine.set_train_batch_size(2 * engine.train_batch_size())  # twice the steps
        """
        per_step = self._config.train_micro_batch_size_per_gpu * self.dp_world_size
        if isinstance(train_batch_size, bool) or not isinstance(train_batch_size, int):
            raise ValueError(f"train_batch_size = {train_batch_size!r}: expected an integer")
        if train_batch_size < 1 or train_batch_size % per_step:
            raise ValueError(
                f"train_batch_size = {train_batch_size} must be a positive multiple of "
                f"train_micro_batch_size_per_gpu ({self._config.train_micro_batch_size_per_gpu})"
                f" x data-parallel size ({self.dp_world_size}) = {per_step}"
            )
        self._set_triad(train_batch_size, train_batch_size // per_step)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro-batch size, keeping the accumulation steps (the global batch size
        follows), as DeepSpeed does. Loaders built afterwards use the new size."""
        if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int):
            raise ValueError(f"micro_batch_size = {micro_batch_size!r}: expected an integer")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size = {micro_batch_size}: expected >= 1")
        gas = self._config.gradient_accumulation_steps
        self._config = replace_config(
            self._config,
            train_batch_size=micro_batch_size * gas * self.dp_world_size,
            train_micro_batch_size_per_gpu=micro_batch_size,
        )

    def _set_triad(self, train_batch_size: int, gas: int) -> None:
        self._config = replace_config(
            self._config, train_batch_size=train_batch_size, gradient_accumulation_steps=gas
        )
        optimizer = self.optimizer
        if optimizer is not None and hasattr(optimizer, "gradient_accumulation_steps"):
            optimizer.gradient_accumulation_steps = gas

    # --- accessors of optional sections and derived values --------------------------------------

    def is_first_weights_partition_group(self) -> bool:
        """DeepSpeed's name for :meth:`zero_optimization_partition_weights` (one ZeRO-3 group)."""
        return self.zero_optimization_partition_weights()  # type: ignore[attr-defined]

    def zero_cpu_offload(self) -> bool:
        """Whether the optimizer state is offloaded to the CPU."""
        return self._config.zero_optimization.offload_optimizer.device == "cpu"

    def zero_nvme_offload_optimizer(self) -> bool:
        """Whether the optimizer state is swapped to NVMe."""
        return self._config.zero_optimization.offload_optimizer.device == "nvme"

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: the config's, else the training dtype."""
        names = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
        configured = self._config.communication_data_type
        if configured is not None:
            return names[configured] if isinstance(configured, str) else configured
        return names[self._config.param_dtype_name]

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """``(model dtype, gradient accumulation dtype)``: ds accumulates in the model dtype."""
        names = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
        dtype = names[self._config.param_dtype_name]
        return dtype, dtype

    def optimizer_name(self) -> str | None:
        """The client optimizer's class name, else the config's ``optimizer.type``."""
        if self.client_optimizer is not None:
            return type(self.client_optimizer).__name__
        section = self._config.optimizer
        return section.type if section is not None else None

    def optimizer_params(self) -> dict[str, Any] | None:
        """The config's ``optimizer.params`` (None without an optimizer section)."""
        section = self._config.optimizer
        return dict(section.params) if section is not None else None

    def scheduler_name(self) -> str | None:
        """The config's ``scheduler.type`` (None without a scheduler section)."""
        section = self._config.scheduler
        return section.type if section is not None else None

    def scheduler_params(self) -> dict[str, Any] | None:
        """The config's ``scheduler.params`` (None without a scheduler section)."""
        section = self._config.scheduler
        return dict(section.params) if section is not None else None

    def autotuning_metric_path(self) -> str:
        """Where an autotuning experiment writes its metrics (default
        ``./autotuning_metric.json``, as DeepSpeed)."""
        from ds_engine.autotuning import AutotuningConfig

        return AutotuningConfig.from_section(self._config.unimplemented.autotuning).metric_file

    def autotuning_model_info_path(self) -> str:
        """Where it writes the model information (default ``./autotuning_model_info.json``)."""
        from ds_engine.autotuning import AutotuningConfig

        config = AutotuningConfig.from_section(self._config.unimplemented.autotuning)
        return config.model_info_file

    def autotuning_profile_model_info(self) -> bool:
        """Whether this run profiles the model information (``autotuning.enabled`` and
        ``model_info.profile``)."""
        section = self._config.unimplemented.autotuning
        info = section.model_info
        return bool(section.enabled and info and info.get("profile"))

    def get_type(self) -> list[Any]:
        """Each param group's ``type`` entry (0.0 where a group has none), as DeepSpeed."""
        if self.optimizer is None:
            return []
        return [g.get("type", 0.0) for g in self.optimizer.optimizer.param_groups]

    # --- datasets ------------------------------------------------------------------------------

    @staticmethod
    def is_map_style_dataset(obj: Any) -> bool:
        """Whether ``obj`` is indexable with a length (a map-style dataset)."""
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj: Any) -> bool:
        """Whether ``obj`` is a ``torch.utils.data.IterableDataset``."""
        return isinstance(obj, torch.utils.data.IterableDataset)

    # --- state dicts ---------------------------------------------------------------------------

    def module_state_dict(
        self,
        destination: dict[str, Any] | None = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict[str, Any]:
        """The module's ``state_dict`` (as DeepSpeed: ZeRO-3 partitioned parameters appear as
        their local placeholders; see :meth:`_zero3_consolidated_16bit_state_dict`)."""
        state = self.module.state_dict(
            destination=cast(Any, destination), prefix=prefix, keep_vars=keep_vars
        )
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters():
                if not p.requires_grad:
                    state.pop(prefix + name, None)
        return state

    def load_module_state_dict(
        self,
        checkpoint: Mapping[str, Any],
        strict: bool = True,
        custom_load_fn: Callable[..., Any] | None = None,
        fetch_z3_params: bool = False,
        z3_params_to_fetch: list[torch.nn.Parameter] | None = None,
        allowed_missing_keys: list[str] | None = None,
    ) -> None:
        """Load ``checkpoint["module"]`` into the module (``custom_load_fn(src=, dst=)`` when
        given). ZeRO-3 parameters named by ``fetch_z3_params``/``z3_params_to_fetch`` are
        gathered, loaded on rank 0 and re-partitioned from it; the optimizer's fp32 masters are
        then rebuilt from the weights."""
        if z3_params_to_fetch is not None:
            fetch = [p for p in z3_params_to_fetch if _is_partitioned(p)]
        elif fetch_z3_params:
            fetch = [p for p in self.module.parameters() if _is_partitioned(p)]
        else:
            fetch = []
        state = checkpoint["module"]
        with GatheredParameters(fetch, modifier_rank=0 if fetch else None):
            if custom_load_fn is not None:
                custom_load_fn(src=state, dst=self.module)
            else:
                result = self.module.load_state_dict(
                    state, strict=strict and allowed_missing_keys is None
                )
                if strict and allowed_missing_keys is not None:
                    missing = set(result.missing_keys) - set(allowed_missing_keys)
                    if missing or result.unexpected_keys:
                        raise RuntimeError(
                            f"module state does not match the model: missing {sorted(missing)}, "
                            f"unexpected {sorted(result.unexpected_keys)}"
                        )
        if self.optimizer is not None and hasattr(self.optimizer, "refresh_fp32_params"):
            self.optimizer.refresh_fp32_params()

    def _zero3_consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> OrderedDict[str, torch.Tensor] | None:
        """The whole model's weights in their training dtype on rank 0's CPU (None on other
        ranks), gathered one tensor at a time; every rank must call it (ZeRO-3 only).

        Raises:
            ValueError: the engine is not at ZeRO stage 3 (DeepSpeed's error).
        """
        if not self.zero_optimization_partition_weights():  # type: ignore[attr-defined]
            raise ValueError(
                "_zero3_consolidated_16bit_state_dict requires ZeRO-3 "
                f"(zero_optimization.stage = {self._config.zero_optimization.stage}); use "
                "module_state_dict()"
            )
        rank = ds_comm.get_rank() if ds_comm.is_initialized() else 0
        frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
        # MoE experts from every expert-parallel rank, under their global ids (the whole model)
        state = whole_state_dict(self.module, exclude=frozen if exclude_frozen_parameters else ())
        return state if rank == 0 else None

    def _consolidated_16bit_state_dict(
        self, exclude_frozen_parameters: bool = False
    ) -> OrderedDict[str, torch.Tensor] | None:
        """DeepSpeed's dispatch over partitioned weights (accelerate's ``get_state_dict`` calls
        it): :meth:`_zero3_consolidated_16bit_state_dict` at ZeRO-3; every rank must call it.

        Raises:
            ValueError: the weights are not partitioned (DeepSpeed also serves tensor
                parallelism here, which ds does not implement; use ``module_state_dict()``).
        """
        if not self.zero_optimization_partition_weights():  # type: ignore[attr-defined]
            raise ValueError(
                "_consolidated_16bit_state_dict applies only where weights are partitioned "
                f"(ZeRO-3); zero_optimization.stage = {self._config.zero_optimization.stage} "
                "keeps every weight whole: use module_state_dict()"
            )
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """DeepSpeed's older name of ``save_16bit_model``."""
        return self.save_16bit_model(save_dir, save_filename)  # type: ignore[attr-defined]

    # --- timers, caches, compile, teardown -----------------------------------------------------

    def get_wall_clock_timers(self) -> dict[str, float]:
        """Milliseconds spent in ``fwd``, ``bwd`` and ``step`` since the last progress line
        (empty unless ``wall_clock_breakdown``), DeepSpeed's timer names."""
        return self.timers.snapshot_ms()

    def empty_partition_cache(self) -> None:
        """Release ZeRO-3's gathered (non-persistent) parameters and the accelerator's cached
        memory."""
        partitioner = getattr(self.optimizer, "partitioner", None)  # ZeRO-3's
        if partitioner is not None:
            partitioner.release_all()
        gc.collect()
        get_accelerator().empty_cache()

    def compile(
        self,
        backend: str = "inductor",
        compile_kwargs: Mapping[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """``torch.compile`` the module in place (``nn.Module.compile``) with ``backend`` and
        ``compile_kwargs``; a second call is a no-op, as DeepSpeed.

        Raises:
            NotImplementedError: ``schedule`` (DeepCompile) or ``compiled_autograd_enabled``.
        """
        if schedule is not None:
            raise NotImplementedError(
                "compile(schedule=...): DeepCompile schedules are not implemented in ds; call "
                "compile() without a schedule for a plain torch.compile"
            )
        if compiled_autograd_enabled:
            raise NotImplementedError(
                "compile(compiled_autograd_enabled=True): compiled autograd is not implemented "
                "in ds; leave it False"
            )
        if self.is_compiled:
            return
        kwargs = dict(compile_kwargs or {})
        kwargs["backend"] = backend
        self.module.compile(**kwargs)
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        """Whether :meth:`compile` has compiled the module."""
        return getattr(self, "_is_compiled", False)

    # --- state offload between training phases (RLHF) -------------------------------------------

    def offload_states(
        self,
        include: Collection[OffloadStateTypeEnum | str] | None = None,
        device: str = "cpu",
        pin_memory: bool = True,
        non_blocking: bool = False,
    ) -> None:
        """Move the optimizer's state (``include``: ``OffloadStateTypeEnum`` kinds, None: all)
        from the accelerator to host memory until :meth:`reload_states`, as RLHF loops do
        around generation; see ds-zero's [Note: relocating storages, not tensors].

        Raises:
            ValueError: ``device`` other than ``"cpu"``/``"none"``, ``offload_param`` enabled, or
                an engine without an optimizer.
        """
        optimizer = self._state_optimizer("offload_states")
        target = getattr(device, "value", device)
        if target == "none":
            logger.warning("offload_states(device='none'): no device to offload to; nothing moved")
            return
        if target != "cpu":
            raise ValueError(
                f"offload_states(device={target!r}): only 'cpu' is supported (as DeepSpeed); "
                "pass device=OffloadDeviceEnum.cpu"
            )
        ds_zero.offload_states(optimizer, include, pin_memory=pin_memory, non_blocking=non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Move what :meth:`offload_states` moved back to the accelerator."""
        ds_zero.reload_states(self._state_optimizer("reload_states"), non_blocking=non_blocking)

    def _state_optimizer(self, verb: str) -> Any:
        if self.optimizer is None:
            raise ValueError(
                f"{verb}(): the engine has no optimizer, so there is no training state to move "
                "(pass an optimizer or an 'optimizer' config section to initialize())"
            )
        if self._config.zero_optimization.offload_param.device != "none":
            raise ValueError(
                f"{verb}(): zero_optimization.offload_param.device = "
                f"{self._config.zero_optimization.offload_param.device!r} keeps the parameters "
                "off the device already; moving states is not supported with parameter offload "
                "(as DeepSpeed); set offload_param.device to 'none'"
            )
        return self.optimizer

    def collect_python_gc(self) -> int:
        """Run Python's cyclic garbage collector now (at a boundary the caller chooses);
        returns the number of objects collected."""
        return gc.collect()

    def destroy(self) -> None:
        """Release what the engine holds beyond Python references: the optimizer's (its
        ``destroy()`` where it has one, e.g. NVMe swap files), the monitors (flushed and
        closed: the W&B run finishes) and the cached memory."""
        optimizer = self.optimizer
        if optimizer is not None and hasattr(optimizer, "destroy"):
            optimizer.destroy()
        self.monitor.close()
        self.empty_partition_cache()

    def zero_grad(self) -> None:
        """Drop every gradient: the parameters' ``.grad`` become None, and the ZeRO optimizer's
        accumulated (flat or partitioned) gradients zero (its flat buffer's views are the
        ``.grad`` of the parameters it manages again afterwards)."""
        for p in self.module.parameters():
            p.grad = None
        if self.optimizer is not None and hasattr(self.optimizer, "zero_grad"):
            self.optimizer.zero_grad()
