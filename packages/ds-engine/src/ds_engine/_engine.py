"""``DeepSpeedEngine``: a module, its optimizer and schedule, trained as a DeepSpeed config says.

[Note: what the engine adds to ds-zero]
ds-zero's gradient-step core (``ds_zero.ZeroOptimizer``, ``Stage3Optimizer`` or, for an
optimizer that reduces its own gradients, ``SelfReducingStep``; built by ``_build.py`` for this
engine and the pipeline engine alike) owns the accumulation window, gradients, reductions, loss
scaling, clipping and the optimizer step, and reports each step as a ``ds_optim.StepResult``;
the engine drives it through the ``ds_optim.GradientStep`` protocol. The engine adds what DeepSpeed users expect around it: placing the model on
the accelerator's device and casting its parameters to fp16/bf16, building the optimizer and LR schedule from the config (or taking the client's),
calling the core's ``step()`` after every micro-batch (the core says whether it stepped), stepping
the schedule only on steps that were not skipped for overflow,
the data loader, checkpoints and what rank 0 prints.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

import ds_comm
from ds_engine._absent import ABSENT, absent_error
from ds_engine._accessors import install_config_accessors
from ds_engine._autotp_engine import apply_autotp
from ds_engine._build import (
    build_client_optimizer,
    build_gradient_step,
    build_scheduler,
    model_parallel_norm_options,
)
from ds_engine._data_efficiency import DataEfficiencyMixin
from ds_engine._engine_surface import EngineSurface
from ds_engine._flops_engine import EngineFlopsProfile
from ds_engine._loader import DeepSpeedDataLoader, build_loader
from ds_engine._moe import (
    checkpoint_names_of,
    configure_experts,
    moe_param_groups,
    process_groups_of,
)
from ds_engine._monitor import build_monitor
from ds_engine._nvme import nvme_swapper
from ds_engine._placement import (
    cast_mixed_precision,
    config_as_dict,
    engine_device,
    move_module,
)
from ds_engine._progress import Progress, numerics_table
from ds_engine._sequence_parallel import check_sequence_composition, sequence_groups
from ds_engine.api import ConfigError, DeepSpeedConfig
from ds_engine.autotuning._probe import start_probe
from ds_engine.utils.timer import EngineTimers
from ds_optim import GradientStep, build_loss_scaler
from ds_zero import MemoryBreakdown

__all__ = ["DeepSpeedEngine"]


def _dp_group_of(mpu: Any) -> tuple[Any, int, int]:
    """The data-parallel group (None: the default one), this rank's index in it and its size."""
    group = mpu.get_data_parallel_group() if mpu is not None else None
    if not ds_comm.is_initialized():
        return group, 0, 1
    return group, ds_comm.get_rank(group), ds_comm.get_world_size(group)


class DeepSpeedEngine(EngineSurface, DataEfficiencyMixin, nn.Module):
    """Trains ``model`` as ``config`` says (see [Note: what the engine adds to ds-zero]).

    Build it with :func:`ds_engine.initialize`. The loop is DeepSpeed's::

        for batch in engine.training_dataloader:
            loss = engine(batch)
            engine.backward(loss)
            engine.step()

    Attributes:
        module: the wrapped model.
        config: the user's config dict, as DeepSpeed's ``engine.config`` (``_config``: the
            parsed :class:`DeepSpeedConfig` the engine reads).
        device: the accelerator's device of this rank (see [Note: where the engine puts the
            model]); ``local_rank``, ``global_rank``, ``world_size``, ``dp_world_size``,
            ``mp_world_size`` and ``seq_dp_world_size`` as in DeepSpeed.
        optimizer: the ZeRO optimizer (or the 1-bit optimizer's step wrapper).
        basic_optimizer: the torch optimizer it steps (the client's or the config's).
        monitor: ``(tag, value, step)`` events (see ``_monitor.py``).
        lr_scheduler: the LR schedule, stepped once per optimizer step (None: constant).
        expert_groups: ds-moe's process groups of the model's MoE layers (None without any;
            see [Note: MoE under the engine]).
        training_dataloader: the loader over ``training_data`` (None when none was given).
        global_steps: optimizer steps taken, including ones skipped for fp16 overflow.
        global_samples: samples consumed by those steps over all data-parallel ranks.
    """

    def __init__(
        self,
        model: nn.Module,
        config: DeepSpeedConfig,
        *,
        optimizer: Any = None,
        model_parameters: Iterable[Any] | None = None,
        lr_scheduler: Any = None,
        mpu: Any = None,
        training_data: Any = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        config_dict: Mapping[str, Any] | None = None,
        device_rank: int | None = None,
    ) -> None:
        super().__init__()
        self.module = model
        self._config = config
        self.config = dict(config_dict) if config_dict is not None else config_as_dict(config)
        self.mpu = apply_autotp(model, config, mpu)  # tensor_parallel.autotp_size: shard now
        self._place(model, device_rank)
        if config.comms_logger.enabled:
            ds_comm.configure(config.comms_logger)
        cast_mixed_precision(model, config)
        self.expert_groups = configure_experts(model, mpu)
        check_sequence_composition(self, config.sequence_parallel_size)
        _publish_groups(mpu, self.expert_groups)
        client = self._build_client_optimizer(optimizer, model_parameters)
        self.client_optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        self.basic_optimizer = client
        self.client_lr_scheduler = lr_scheduler
        self.self_reducing = bool(getattr(client, "reduces_gradients", False))
        self.loss_scaler = build_loss_scaler(config.fp16) if config.fp16.enabled else None
        self.optimizer: GradientStep | None = self._wrap(client) if client is not None else None
        self.lr_scheduler = self._build_scheduler(lr_scheduler)
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._step_applied = False
        self._boundary: bool | None = None
        self._losses: list[torch.Tensor] = []
        self.timers = EngineTimers(config.wall_clock_breakdown)
        self._flops = EngineFlopsProfile(self, config.flops_profiler)
        self.flops_profiler = self._flops.profiler  # DeepSpeed's attribute (None: disabled)
        self.progress = Progress(
            rank=self.global_rank,
            steps_per_print=config.steps_per_print,
            throughput=config.timers.throughput.enabled,
            synchronized=config.timers.throughput.synchronized,
        )
        self.monitor = build_monitor(config, rank=self.global_rank)
        self._autotuning = start_probe(config.unimplemented.autotuning, self)
        self._setup_data_efficiency()
        self.training_dataloader: DeepSpeedDataLoader | None = None
        if training_data is not None:
            self.training_dataloader = self.deepspeed_io(training_data, collate_fn=collate_fn)
        self.progress.write(numerics_table(config, self_reducing=self.self_reducing))

    def _place(self, model: nn.Module, device_rank: int | None) -> None:
        """Ranks, group sizes and the device (see [Note: where the engine puts the model])."""
        self.dp_group, self.dp_rank, self.dp_world_size = _dp_group_of(self.mpu)
        initialized = ds_comm.is_initialized()
        self.global_rank = ds_comm.get_rank() if initialized else 0
        self.world_size = ds_comm.get_world_size() if initialized else 1
        self.local_rank = ds_comm.get_local_rank()
        self.mp_world_size = self.mpu.get_model_parallel_world_size() if self.mpu is not None else 1
        # Ulysses: ZeRO shards over sp x dp (see [Note: Ulysses under the engine]).
        seq = sequence_groups(self.mpu, self.dp_group, self.dp_rank, self.dp_world_size)
        self.sequence_parallel_size, self.seq_parallel_group = seq.size, seq.group
        self.seq_data_parallel_group, self.seq_dp_rank = seq.data_group, seq.data_rank
        self.seq_dp_world_size = seq.data_world_size
        self.device = engine_device(self.local_rank if device_rank is None else device_rank)
        move_module(model, self.device)

    def __getattr__(self, name: str) -> Any:
        if name in ABSENT:
            raise absent_error("DeepSpeedEngine", name)
        return super().__getattr__(name)

    # --- construction ----------------------------------------------------------------------------

    def _build_client_optimizer(self, optimizer: Any, model_parameters: Any) -> Any:
        params = model_parameters if model_parameters is not None else self.module.parameters()
        if self.expert_groups is not None:
            params = moe_param_groups(params)
        group = self.seq_data_parallel_group
        return build_client_optimizer(self._config, optimizer, params, group=group)

    def _wrap(self, client: torch.optim.Optimizer) -> GradientStep:
        config = self._config
        if self.self_reducing and self.expert_groups is not None:
            raise ConfigError(
                f"optimizer {type(client).__name__} reduces its own gradients over one "
                "group, which MoE expert parameters cannot use; choose Adam/AdamW or another "
                "optimizer that ds-zero reduces"
            )
        if self.self_reducing:
            return build_gradient_step(
                self.module,
                client,
                config,
                group=self.seq_data_parallel_group,
                loss_scaler=self.loss_scaler,
            )
        return build_gradient_step(
            self.module,
            client,
            config,
            group=self.seq_data_parallel_group,
            loss_scaler=self.loss_scaler,
            swapper=nvme_swapper(config, self.module),
            param_group_process_groups=process_groups_of(client, self.expert_groups),
            # ZeRO-3 shards name experts by global id: they reshard across ep_size
            checkpoint_names=checkpoint_names_of(self.module, self.expert_groups),
            # prescale_gradients: all of the averaging before the sum (see docs/engine.md)
            gradient_predivide_factor=(
                None if config.prescale_gradients else config.gradient_predivide_factor
            ),
            communication_data_type=config.communication_data_type,
            # the norm over the mpu's model-parallel group too, replicated parameters once
            **model_parallel_norm_options(self.module, self.mpu),
        )

    def _build_scheduler(self, lr_scheduler: Any) -> Any:
        torch_optimizer = self.optimizer.optimizer if self.optimizer is not None else None
        return build_scheduler(self._config, lr_scheduler, torch_optimizer)

    # --- training --------------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module (floating-point inputs cast to fp16 with ``fp16.auto_cast``)."""
        if self._config.fp16.enabled and self._config.fp16.auto_cast:
            inputs = tuple(_to_half(x) for x in inputs)
            kwargs = {k: _to_half(v) for k, v in kwargs.items()}
        kwargs = self._data_efficiency_kwargs(kwargs)  # curriculum_seqlen, pld_theta
        with self._flops.forward(self.global_steps), self.timers.forward():
            return self.module(*inputs, **kwargs)

    def _require_optimizer(self) -> Any:
        if self.optimizer is None:
            raise RuntimeError(
                "this engine has no optimizer: pass optimizer= to initialize() or add an "
                "'optimizer' section to the config"
            )
        return self.optimizer

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """Backpropagate ``loss`` (divided by the accumulation steps unless ``scale_wrt_gas`` is
        False), with the fp16 loss scale, and reduce gradients when due.

        Returns:
            the loss as backpropagated before loss scaling: ``loss / gradient_accumulation_steps``
            (``loss`` itself with ``scale_wrt_gas=False``), as DeepSpeed 0.19 returns it.
        """
        optimizer = self._require_optimizer()
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError(
                f"backward(loss): expected a scalar loss tensor, got "
                f"{tuple(loss.shape) if torch.is_tensor(loss) else type(loss).__name__}"
            )
        self._losses.append(loss.detach())
        gas = self._config.gradient_accumulation_steps
        with self.timers.backward(loss):
            # The optimizer divides by the accumulation steps; undo that when not wanted.
            optimizer.backward(loss if scale_wrt_gas else loss * gas, retain_graph=retain_graph)
        return loss / gas if scale_wrt_gas else loss

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch is the last of its accumulation window (the
        gradient step keeps the window; without an optimizer, the micro-batches are counted)."""
        if self.optimizer is not None:
            return self.optimizer.is_gradient_accumulation_boundary()
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self._config.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Override the boundary (pipeline schedules); None returns to counting micro-batches."""
        self._boundary = is_boundary
        if self.optimizer is not None:
            self.optimizer.set_gradient_accumulation_boundary(is_boundary)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally without reducing (stages 0 and 1).

        Example:
            >>> with engine.no_sync():
            ...     engine.backward(engine(batch_a))
            >>> engine.backward(engine(batch_b))  # reduces both
        """
        if self._config.zero_optimization.stage >= 2:
            raise RuntimeError(
                f"no_sync() is incompatible with ZeRO stage {self.zero_optimization_stage()}: "
                "stage 2 reduces every micro-batch into its gradient shard (as in DeepSpeed)"
            )
        optimizer = self._require_optimizer()
        previous = optimizer.boundary_override
        optimizer.set_gradient_accumulation_boundary(False)
        try:
            yield
        finally:
            optimizer.set_gradient_accumulation_boundary(previous)

    def step(self, lr_kwargs: Mapping[str, Any] | None = None) -> None:
        """Call after every ``backward``: steps the optimizer and the LR schedule at the
        accumulation boundary (the schedule not on steps skipped for non-finite gradients, with
        ``lr_kwargs`` as keyword arguments of its ``step``). The gradient step keeps the window
        and says what it did (a :class:`ds_optim.StepResult`)."""
        optimizer = self._require_optimizer()
        with self.timers.step(getattr(optimizer, "optimizer", None)):
            result = optimizer.step()
        self.timers.update_cache()
        self.micro_steps += 1
        self._step_applied = result.applied
        if not result.boundary:
            return
        self._data_efficiency_boundary()  # before counting the step, as DeepSpeed
        self.global_steps += 1
        self.global_samples += self._config.train_batch_size
        if result.overflow:
            self.skipped_steps += 1
            cause = "fp16 gradient overflow" if self.loss_scaler is not None else "inf/nan gradient"
            self.progress.write(
                f"step {self.global_steps}: {cause}, step skipped on all ranks; "
                f"loss scale -> {result.loss_scale:g}"
            )
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        self._flops.step_done(self.global_steps - 1, self.global_steps)
        self._report()
        if self._autotuning is not None:  # an autotuning experiment: measure, report, exit
            self._autotuning.after_step(self)

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` changed the parameters: False off the accumulation
        boundary and on steps skipped for fp16 overflow."""
        return self._step_applied

    def _report(self) -> None:
        loss = None
        if self._losses:
            loss = float(torch.stack([x.float() for x in self._losses]).mean())
            self._losses.clear()
        printing = self.global_steps % self._config.steps_per_print == 0
        lr = self.get_lr()
        self.progress.update(
            step=self.global_steps,
            samples=self.global_samples,
            loss=loss,
            lr=lr[0] if lr else 0.0,
            timers="",
        )
        if printing:  # DeepSpeed's breakdown lines (wall_clock_breakdown)
            for line in self.timers.report(int(self._config.steps_per_print)):
                self.progress.write(line)
        if self._config.memory_breakdown and printing:
            self.progress.write(f"memory: {self.memory_usage()}")
        if self.monitor.enabled:
            events = [("Train/Samples/lr", lr[0] if lr else 0.0, self.global_samples)]
            if loss is not None:
                events.insert(0, ("Train/Samples/train_loss", loss, self.global_samples))
            if self.loss_scaler is not None:
                assert self.optimizer is not None  # _report runs after step() stepped it
                scale = self.optimizer.loss_scale
                events.append(("Train/Samples/loss_scale", scale, self.global_samples))
            self.monitor.write_events(events)

    # --- state -----------------------------------------------------------------------------------

    def get_lr(self) -> list[float]:
        """The learning rate of each param group."""
        if self.optimizer is None:
            return []
        return [float(g["lr"]) for g in self.optimizer.optimizer.param_groups]

    def get_mom(self) -> list[Any]:
        """Each param group's momentum: Adam's ``betas`` or SGD's ``momentum``."""
        if self.optimizer is None:
            return []
        groups = self.optimizer.optimizer.param_groups
        return [g["betas"] if "betas" in g else g.get("momentum") for g in groups]

    def get_global_grad_norm(self) -> float | None:
        """L2 norm of the last step's unscaled gradients before clipping."""
        return self.optimizer.get_global_grad_norm() if self.optimizer is not None else None

    def memory_usage(self) -> MemoryBreakdown:
        """Bytes this rank holds for parameters, gradients and optimizer state (ds-zero's
        breakdown; ``memory_breakdown()`` is DeepSpeed's config flag)."""
        return self._require_optimizer().memory_breakdown()

    def deepspeed_io(
        self,
        dataset: Any,
        batch_size: int | None = None,
        route: str = "train",
        pin_memory: bool = True,
        data_sampler: Any = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_local_io_workers: int | None = None,
    ) -> DeepSpeedDataLoader:
        """A loader of micro-batches over this rank's share of ``dataset`` (see
        :func:`build_loader`)."""
        return build_loader(
            self,
            dataset,
            batch_size=batch_size,
            route=route,
            pin_memory=pin_memory,
            data_sampler=data_sampler,
            collate_fn=collate_fn,
            num_local_io_workers=num_local_io_workers,
        )

    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: Mapping[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Save to ``save_dir/tag`` atomically (see ``ds_engine._checkpoint``); returns True."""
        from ds_engine._checkpoint import save_checkpoint

        save_checkpoint(
            self,
            save_dir,
            tag=tag,
            client_state=client_state or {},
            save_latest=save_latest,
            exclude_frozen_parameters=exclude_frozen_parameters,
        )
        return True

    def save_16bit_model(
        self,
        save_dir: str,
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Save the module's weights in their training dtype as one plain state dict, written
        atomically by global rank 0 (every rank must call it).

        Under ZeRO stage 3 this needs ``stage3_gather_16bit_weights_on_model_save``: the
        parameters are gathered one at a time into rank 0's host memory. Without it nothing is
        written and False is returned, as DeepSpeed does; ``ds-zero-to-fp32`` or
        ``ds_zero.export_safetensors`` turn a sharded checkpoint into weights instead.
        """
        from ds_engine._checkpoint import save_16bit_model

        return save_16bit_model(
            self, save_dir, save_filename, exclude_frozen=exclude_frozen_parameters
        )

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Callable[..., Any] | None = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load ``load_dir/tag`` (``tag`` None: the one named in ``latest``); the module's
        weights through ``custom_load_fn(src=state_dict, dst=module)`` when given.

        Returns:
            ``(load_path, client_state)``, or ``(None, None)`` when there is nothing to load.
        """
        from ds_engine._checkpoint import load_checkpoint

        return load_checkpoint(
            self,
            load_dir,
            tag=tag,
            strict=load_module_strict,
            optimizer_states=load_optimizer_states and not load_module_only,
            lr_scheduler_states=load_lr_scheduler_states and not load_module_only,
            module_only=load_module_only,
            custom_load_fn=custom_load_fn,
        )


install_config_accessors(DeepSpeedEngine)


def _to_half(value: Any) -> Any:
    if torch.is_tensor(value) and value.is_floating_point():
        return value.half()
    return value


def _publish_groups(mpu: Any, expert_groups: Any) -> None:
    """Let ``deepspeed.utils.groups`` answer from this engine's mpu and expert groups, as
    DeepSpeed's engine does (clients such as Accelerate query groups there, not the engine)."""
    from ds_engine.utils import groups

    groups.mpu = mpu
    groups.register_expert_groups(expert_groups if expert_groups is not None else ())
