"""``initialize()`` for a ``PipelineModule``: ds-pipe's engine configured by a DeepSpeed config.

[Note: the pipeline engine under initialize()]
DeepSpeed's ``PipelineEngine`` subclasses its engine; here :class:`PipelineDeepSpeedEngine`
composes ``ds_pipe.PipelineEngine`` with what the config says: the batch-size triad (the number
of micro-batches per ``train_batch`` is ``gradient_accumulation_steps``; the data-parallel size
is the module topology's ``data`` axis), the optimizer and LR schedule (config sections or the
client's), fp16/bf16 (the module is cast; fp16 gets the ``fp16`` section's loss scaler),
``gradient_clipping`` (the global norm over every stage and replica), and checkpoints.

The gradient step is ds-zero's core, built by ``_build.py`` exactly as for the engine (stage 0
or 1) and handed to ``ds_pipe.PipelineEngine``, which drives it through the
``ds_optim.GradientStep`` protocol: every micro-batch's backward accumulates locally (the
pipeline holds the core's boundary False), the tied-weight gradients are summed, and at the
schedule's step the core reduces (all-reduce at stage 0, reduce-scatter at stage 1), takes the
norm over the data group and the pipeline group (``norm_group``, tied copies excluded), checks
it for inf/nan, clips and steps. Stages 2 and 3 are refused as in DeepSpeed: they reduce (and shard) gradients in every
micro-batch's backward, which fights the pipeline's accumulation over micro-batches (stage 2
would reduce every micro-batch of every stage; stage 3 would also gather parameters per
micro-batch).

[Note: pipeline checkpoints]
``save_dir/<tag>/`` holds the module's per-layer files (``layer_XX-model_states.pt``, from
``PipelineModule.save_state_dict``: a pipeline saved with one number of stages loads with
another, or into a plain ``nn.Module``) and one ``pp_rank_SS_dp_rank_DD_states.pt`` per rank
(optimizer or ZeRO shard state, LR schedule, counters, client state). Written under
``.<tag>.partial`` and renamed by rank 0 after a barrier, then ``latest`` is replaced, as the
engine's checkpoints (see ``_checkpoint.py``). ``load_checkpoint(..., load_module_only=True)``
loads only the layers, so it works across stage counts.

[Note: the pipeline engine's progress and timers]
Every ``steps_per_print`` batches global rank 0 prints DeepSpeed's pipeline line, ``steps: N
loss: L iter time (s): T samples/sec: S`` (the mean ``train_batch()`` time since the last line;
``timers.throughput.enabled`` false drops the samples/sec figure, ``synchronized`` waits for the
accelerator around each batch). With ``wall_clock_breakdown`` ds-pipe's engine times each
schedule instruction through :meth:`EngineTimers.span` (the same marks as the engine's
breakdown) and rank 0 prints DeepSpeed's three ``time (ms)`` lines: ``batch_input`` and the
micro-step timers, the global timers, then the four ``pipe_send/recv`` timers; each is the
total since the last report. ``get_wall_clock_timers()`` gives this rank's totals (its stage's
timers, and ``train_batch``) as of the last batch.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, cast, overload

import torch

import ds_comm
from ds_comm.accelerator import get_accelerator
from ds_engine import __version__
from ds_engine._absent import ABSENT, absent_error
from ds_engine._accessors import install_config_accessors
from ds_engine._build import build_client_optimizer, build_gradient_step, build_scheduler
from ds_engine._checkpoint import check_client_state, resolve_checkpoint, tag_directory
from ds_engine._data_efficiency import (
    PipelineDataEfficiencyMixin,
    refuse_pipeline_data_efficiency,
)
from ds_engine._deepspeed_ckpt import deepspeed_tag_dir, load_deepspeed_pipeline_checkpoint
from ds_engine._engine_surface import EngineSurface
from ds_engine._loader import DeepSpeedDataLoader, build_loader
from ds_engine._monitor import build_monitor
from ds_engine._placement import (
    cast_mixed_precision,
    config_as_dict,
    engine_device,
    move_module,
)
from ds_engine.api import ConfigError, DeepSpeedConfig
from ds_engine.utils.timer import EngineTimers
from ds_optim import GradientStep, build_loss_scaler
from ds_pipe import PIPE_TIMER_NAMES, PipelineEngine, PipelineModule
from ds_zero import save_fsynced

__all__ = ["PipelineDeepSpeedEngine", "check_pipeline_config"]

_LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}


def check_pipeline_config(config: DeepSpeedConfig) -> None:
    """Refuse what a pipeline cannot train with (see [Note: the pipeline engine under
    initialize()])."""
    refuse_pipeline_data_efficiency(config)
    stage = config.zero_optimization.stage
    if stage >= 2:
        raise ConfigError(
            f"zero_optimization.stage = {stage} with a PipelineModule: ZeRO stage {stage} "
            "reduces and partitions gradients in every micro-batch's backward, which conflicts "
            "with the pipeline's gradient accumulation over micro-batches (DeepSpeed refuses it "
            "too); use stage 0 or 1"
        )
    if config.zero_optimization.offload_optimizer.enabled:
        raise ConfigError(
            "zero_optimization.offload_optimizer with a PipelineModule is not supported; remove "
            "offload_optimizer or train without a pipeline"
        )


def _to_dtype(value: Any, dtype: torch.dtype) -> Any:
    if torch.is_tensor(value) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_dtype(v, dtype) for v in value)
    return value


def _repeat(loader: DeepSpeedDataLoader) -> Iterator[Any]:
    """Micro-batches of ``loader`` for ever, epoch after epoch (DeepSpeed's RepeatingLoader)."""
    for _ in itertools.count():
        yield from loader


class PipelineDeepSpeedEngine(EngineSurface, PipelineDataEfficiencyMixin):
    """The engine ``initialize()`` returns for a ``PipelineModule`` (see [Note: the pipeline
    engine under initialize()]).

    Example:
        >>> engine, _, _, _ = ds_engine.initialize(config=cfg, model=pipeline_module)
        >>> loss = engine.train_batch(data_iter)  # gradient_accumulation_steps micro-batches
    """

    def __init__(
        self,
        module: Any,
        config: DeepSpeedConfig,
        *,
        optimizer: Any = None,
        model_parameters: Any = None,
        lr_scheduler: Any = None,
        training_data: Any = None,
        collate_fn: Any = None,
        config_dict: Mapping[str, Any] | None = None,
        device_rank: int | None = None,
    ) -> None:
        check_pipeline_config(config)
        self.module, self._config = module, config
        self.config = dict(config_dict) if config_dict is not None else config_as_dict(config)
        self._place(module, device_rank)
        self.low = _LOW.get(config.param_dtype_name)
        cast_mixed_precision(module, config)
        self.loss_scaler = build_loss_scaler(config.fp16) if config.fp16.enabled else None
        client = self._client_optimizer(optimizer, model_parameters)
        self.client_optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
        self.basic_optimizer = client
        self.timers = EngineTimers(config.wall_clock_breakdown)
        self._batch_seconds = 0.0  # train_batch() time since the last progress line
        self.monitor = build_monitor(config, rank=self.global_rank)
        self.client_lr_scheduler = lr_scheduler
        self.micro_steps = 0  # micro-batches trained
        self.batch_fn: Any = None
        self.has_attention_mask = False
        # the same core as the engine's: fp32 masters for fp16/bf16, sharded state at stage 1
        self.zero: GradientStep | None = None
        if getattr(client, "reduces_gradients", False):
            raise ConfigError(
                f"optimizer {type(client).__name__} reduces its own gradients, which a "
                "PipelineModule does not support (the pipeline's norm and tied weights need the "
                "reduced gradients); choose Adam/AdamW or another optimizer that ds-zero reduces"
            )
        if client is not None:
            self.zero = build_gradient_step(
                module,
                client,
                config,
                group=self.grid.get_group("data"),
                loss_scaler=self.loss_scaler,
                norm_group=self.grid.get_group("pipe"),
                norm_exclude=module.tied_params_owned_elsewhere(),
            )
        self.optimizer = client
        self.lr_scheduler = self._scheduler(lr_scheduler)
        self.pipe = PipelineEngine(
            module,
            client,
            micro_batches=config.gradient_accumulation_steps,
            schedule="interleaved" if module.num_virtual_stages > 1 else "1f1b",
            gradient_clipping=config.gradient_clipping,
            loss_scaler=self.loss_scaler,
            lr_scheduler=self.lr_scheduler,
            grad_step=self.zero,
            timer=self.timers.span if config.wall_clock_breakdown else None,
        )
        self.training_dataloader: DeepSpeedDataLoader | None = None
        if training_data is not None:
            self.set_dataloader(self.deepspeed_io(training_data, collate_fn=collate_fn))

    def _place(self, module: Any, device_rank: int | None) -> None:
        """Ranks, sizes and the device, as the engine's (the module's grid is the mpu)."""
        from ds_engine.utils import groups  # (lazily, as the engine does)

        self.grid = module.grid
        self.mpu = module.mpu()
        groups.mpu = self.mpu  # deepspeed.utils.groups answers from the module's ParallelGrid
        groups.register_expert_groups(())
        self.dp_rank = self.grid.axis_rank("data")
        self.dp_world_size = self.grid.axis_world_size("data")
        self.seq_dp_world_size = self.dp_world_size
        self.mp_world_size = self.mpu.get_model_parallel_world_size()
        self.global_rank = ds_comm.get_rank()
        self.world_size = ds_comm.get_world_size()
        self.local_rank = ds_comm.get_local_rank()
        self.stage_id = self.grid.stage_id
        self.num_stages = self.grid.num_stages
        self.device = engine_device(self.local_rank if device_rank is None else device_rank)
        move_module(module, self.device)

    def _client_optimizer(self, optimizer: Any, model_parameters: Any) -> Any:
        params = model_parameters if model_parameters is not None else self.module.parameters()
        group = self.grid.get_group("data")
        return build_client_optimizer(self._config, optimizer, params, group=group)

    def _scheduler(self, lr_scheduler: Any) -> Any:
        return build_scheduler(self._config, lr_scheduler, self.optimizer)

    # --- the pipeline surface ------------------------------------------------------------------

    # DeepSpeed's dtype codes of its activation metadata (for code that encodes with them).
    ID_TO_DTYPE: ClassVar[list[torch.dtype]] = [
        torch.float32, torch.float64, torch.complex64, torch.complex128, torch.float16,
        torch.bfloat16, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.bool,
    ]  # fmt: skip
    DTYPE_TO_ID: ClassVar[dict[torch.dtype, int]] = {
        dtype: index for index, dtype in enumerate(ID_TO_DTYPE)
    }

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Train on ``gradient_accumulation_steps`` micro-batches; the mean loss on every stage."""
        data_iter = self._prepare(data_iter)
        synchronized = self._config.timers.throughput.synchronized
        if synchronized:
            get_accelerator().synchronize()
        start = time.perf_counter()
        with self.timers.span(("train_batch",)):
            loss = self.pipe.train_batch(data_iter)
        if synchronized:
            get_accelerator().synchronize()
        self._batch_seconds += time.perf_counter() - start
        self.micro_steps += self.pipe.micro_batches
        self._report_batch(loss)
        if self.monitor.enabled:
            samples = self.global_samples
            lr = self.get_lr()
            self.monitor.write_events(
                [
                    ("Train/Samples/train_loss", float(loss), samples),
                    ("Train/Samples/lr", lr[0] if lr else 0.0, samples),
                ]
            )
        return loss

    def _report_batch(self, loss: torch.Tensor) -> None:
        """DeepSpeed's pipeline report every ``steps_per_print`` batches (see [Note: the
        pipeline engine's progress and timers])."""
        self.timers.update_cache(("train_batch", *PIPE_TIMER_NAMES))
        every = self._config.steps_per_print
        if self.global_steps % every != 0:
            return
        log = self.timers.timers.log
        log(["batch_input", *self.timers.micro_timers])
        log(self.timers.global_timers)
        if self.global_rank == 0:
            iter_time = self._batch_seconds / every
            line = f"steps: {self.global_steps} loss: {float(loss):0.4f} "
            line += f"iter time (s): {iter_time:0.3f}"
            if self._config.timers.throughput.enabled:
                line += f" samples/sec: {self._config.train_batch_size / max(iter_time, 1e-9):0.3f}"
            print(line, flush=True)
        self._batch_seconds = 0.0
        log(["pipe_send_output", "pipe_send_grad", "pipe_recv_input", "pipe_recv_grad"])
        self.timers.timers("train_batch").reset()

    def eval_batch(
        self,
        data_iter: Iterator[Any],
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> Any:
        """Forward one batch without gradients (see ``ds_pipe.PipelineEngine.eval_batch``) of
        ``num_micro_batches`` micro-batches (None: ``gradient_accumulation_steps``).

        ``bcast_loss=False`` is refused: ds always gives every stage the reduced scalar loss.
        """
        if not bcast_loss:
            raise NotImplementedError(
                "eval_batch(bcast_loss=False) is not implemented in ds: every stage gets the "
                "reduced loss; leave bcast_loss=True"
            )
        pipe = self.pipe
        saved = pipe.micro_batches
        if num_micro_batches is not None:
            if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int):
                raise ValueError(f"num_micro_batches = {num_micro_batches!r}: expected an int")
            if num_micro_batches < 1:
                raise ValueError(f"num_micro_batches = {num_micro_batches}: expected >= 1")
            pipe.micro_batches = num_micro_batches
        try:
            return pipe.eval_batch(
                self._prepare(data_iter), return_logits, compute_loss, reduce_output
            )
        finally:
            pipe.micro_batches = saved

    def __getattr__(self, name: str) -> Any:
        if name in ABSENT:
            raise absent_error("PipelineEngine", name)
        raise AttributeError(f"'PipelineEngine' object has no attribute {name!r}")

    def train(self, mode: bool = True) -> PipelineDeepSpeedEngine:
        """Put this stage's layers in training (or eval) mode."""
        self.module.train(mode)
        return self

    def eval(self) -> PipelineDeepSpeedEngine:
        """Put this stage's layers in eval mode."""
        return self.train(False)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Refused, as DeepSpeed: a pipeline runs through :meth:`train_batch`/:meth:`eval_batch`."""
        raise RuntimeError("Only train_batch() is accessible in pipeline mode (forward())")

    __call__ = forward

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        """Refused, as DeepSpeed: :meth:`train_batch` runs the backward passes."""
        raise RuntimeError("Only train_batch() is accessible in pipeline mode (backward())")

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """Refused, as DeepSpeed: :meth:`train_batch` steps the optimizer."""
        raise RuntimeError("Only train_batch() is accessible in pipeline mode (step())")

    def no_sync(self) -> Any:
        """Refused: ``train_batch`` accumulates over its micro-batches and reduces once."""
        raise RuntimeError(
            "no_sync() is not available in pipeline mode: train_batch() accumulates its "
            "micro-batches and reduces once; raise gradient_accumulation_steps instead"
        )

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Refused: the pipeline schedule places the boundary at the end of ``train_batch``."""
        raise RuntimeError(
            f"set_gradient_accumulation_boundary({is_boundary!r}) is not available in pipeline "
            "mode: train_batch() runs a whole accumulation window"
        )

    def save_16bit_model(self, save_dir: str, *args: Any, **kwargs: Any) -> bool:
        """Refused: a pipeline's weights are per-layer files (``save_checkpoint`` writes them and
        ``load_checkpoint(load_module_only=True)`` or ``PipelineModule.load_state_dir`` read
        them, for any number of stages)."""
        raise NotImplementedError(
            f"save_16bit_model({save_dir!r}) is not implemented for a PipelineModule: use "
            "save_checkpoint(), whose layer_XX-model_states.pt files load into any stage count "
            "or a plain nn.Module"
        )

    def deepspeed_io(
        self,
        dataset: Any,
        batch_size: int | None = None,
        route: str = "train",
        pin_memory: bool = True,
        data_sampler: Any = None,
        collate_fn: Any = None,
        num_local_io_workers: int | None = None,
    ) -> DeepSpeedDataLoader:
        """A loader of micro-batches over this replica's share of ``dataset`` (see
        ``ds_engine._loader.build_loader``)."""
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

    def is_first_stage(self) -> bool:
        """True on pipeline stage 0 (which reads the inputs)."""
        return self.pipe.is_first_stage()

    def is_last_stage(self) -> bool:
        """True on the last stage (which reads the labels and computes the loss)."""
        return self.pipe.is_last_stage()

    def get_pipeline_parallel_rank(self) -> int:
        """This rank's pipeline stage."""
        return self.stage_id

    def is_gradient_accumulation_boundary(self) -> bool:
        """False: between ``train_batch`` calls no reduction or step is due (each
        ``train_batch`` ends with its own)."""
        return False

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """The iterator ``train_batch()`` reads when called without one (first and last stage;
        DeepSpeed ignores it on the others)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = None
            self.pipe.set_dataiterator(self._prepare(iterator))

    def set_dataloader(self, loader: Any) -> None:
        """Read micro-batches from ``loader``, epoch after epoch (first and last stage)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.pipe.set_dataiterator(self._prepare(_repeat(loader)))

    def set_batch_fn(self, fn: Any) -> None:
        """Post-process every micro-batch read from a data iterator with ``fn``."""
        self.batch_fn = fn

    def set_has_attention_mask(self, value: bool) -> None:
        """DeepSpeed's flag that the last input is a mask needing no gradient. ds sends each
        tensor with its own dtype and ``requires_grad``, so a mask is handled without it; the
        value is checked and kept for code that reads ``has_attention_mask``."""
        if not isinstance(value, bool):
            raise TypeError(f"set_has_attention_mask({value!r}): expected a bool")
        self.has_attention_mask = value

    def reset_activation_shape(self) -> None:
        """Renegotiate activation and gradient shapes at the next batch (call before a batch
        whose shapes change, e.g. curriculum sequence lengths), on every rank."""
        for mode in ("train", "eval"):
            self.pipe.channels.forget(mode)

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the batch size through the number of micro-batches per ``train_batch``."""
        super().set_train_batch_size(train_batch_size)
        gas = self._config.gradient_accumulation_steps
        self.pipe.micro_batches = gas
        if self.zero is not None:
            self.zero.gradient_accumulation_steps = gas

    def get_additional_losses(self) -> None:
        """None: ds's pipeline modules return one loss (no auxiliary losses are aggregated)."""
        return None

    def log_for_device(self, *msg: Any) -> None:
        """Print ``msg`` prefixed with this rank's pipeline and data coordinates."""
        print(
            f"RANK={self.global_rank} PIPE-ID={self.stage_id} DATA-ID={self.dp_rank} "
            f"STEP-ID={self.global_steps} ::",
            *msg,
            flush=True,
        )

    def tput_log(self, *msg: Any) -> None:
        """Print ``msg`` on global rank 0 every ``steps_per_print`` batches."""
        if self.global_rank == 0 and self.global_steps % self._config.steps_per_print == 0:
            print(*msg, flush=True)

    @overload
    def _prepare(self, data_iter: Iterator[Any]) -> Iterator[Any]: ...
    @overload
    def _prepare(self, data_iter: Iterator[Any] | None) -> Iterator[Any] | None: ...
    def _prepare(self, data_iter: Iterator[Any] | None) -> Iterator[Any] | None:
        """Micro-batches through ``batch_fn`` (read when each is loaded) and, with fp16/bf16,
        floating-point inputs cast to the parameters' dtype (labels as given), as DeepSpeed's
        pipeline engine does."""
        if data_iter is None:
            return None
        return (self._cast(self.batch_fn(b) if self.batch_fn else b) for b in data_iter)

    def _cast(self, batch: Any) -> Any:
        if self.low is None:
            return batch
        inputs, labels = batch
        return _to_dtype(inputs, self.low), labels

    @property
    def global_steps(self) -> int:
        """Batches trained (skipped fp16 steps included)."""
        return self.pipe.global_steps

    @property
    def skipped_steps(self) -> int:
        """Batches whose step an fp16 overflow skipped."""
        return self.pipe.skipped_steps

    @property
    def global_samples(self) -> int:
        """Samples trained on over all data-parallel replicas."""
        return self.pipe.global_steps * self._config.train_batch_size

    def was_step_applied(self) -> bool:
        """Whether the last ``train_batch`` stepped the optimizer (not skipped for overflow)."""
        last = self.pipe.last_step
        return last is not None and not last.skipped

    def get_lr(self) -> list[float]:
        """The learning rate of each param group."""
        return self.pipe.get_lr()

    def get_mom(self) -> list[Any]:
        """Each param group's momentum: Adam's ``betas`` or SGD's ``momentum``."""
        if self.optimizer is None:
            return []
        groups = self.optimizer.param_groups
        return [g["betas"] if "betas" in g else g.get("momentum") for g in groups]

    def get_type(self) -> list[Any]:
        """Each param group's ``type`` entry (0.0 where a group has none), as DeepSpeed."""
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        return [g.get("type", 0.0) for g in groups]

    def get_global_grad_norm(self) -> float | None:
        """The last step's gradient norm over every stage and replica."""
        return self.pipe.get_global_grad_norm()

    def module_state_dict(  # type: ignore[override]
        self, exclude_frozen_parameters: bool = False
    ) -> dict[str, Any]:
        """This stage's layers' state dict (keys as in the ``PipelineModule``).

        DeepSpeed's pipeline returns None here and writes the per-layer files from inside its
        ``save_checkpoint``; ds's ``save_checkpoint`` writes those itself, so this returns the
        state for code that wants it.
        """
        return super().module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)

    def load_module_state_dict(self, checkpoint: Mapping[str, Any], *args: Any, **kwargs: Any):
        """Load this stage's layers from ``checkpoint["module"]`` (fp32 masters refreshed)."""
        super().load_module_state_dict(checkpoint, *args, **kwargs)
        if self.zero is not None and hasattr(self.zero, "refresh_fp32_params"):
            cast(Any, self.zero).refresh_fp32_params()  # not in GradientStep: checked above

    def zero_grad(self) -> None:
        """Drop every gradient of this stage's parameters (and the ZeRO-1 accumulation)."""
        for p in self.module.parameters():
            p.grad = None
        if self.zero is not None:
            self.zero.zero_grad()

    # --- checkpoints (see [Note: pipeline checkpoints]) ----------------------------------------

    def _state_file(self) -> str:
        return f"pp_rank_{self.grid.stage_id:02d}_dp_rank_{self.dp_rank:02d}_states.pt"

    def _rank_state(self, client_state: Mapping[str, Any]) -> dict[str, Any]:
        optim = self.zero if self.zero is not None else self.optimizer
        return {
            "optimizer": optim.state_dict() if optim is not None else None,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else None,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None,
            "global_steps": self.pipe.global_steps,
            "skipped_steps": self.pipe.skipped_steps,
            "loader": self.training_dataloader.state_dict() if self.training_dataloader else None,
            "client_state": dict(client_state),
            "ds_version": __version__,
        }

    def save_checkpoint(
        self,
        save_dir: str,
        tag: str | None = None,
        client_state: Mapping[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Save the layers and every rank's state to ``save_dir/tag`` atomically; returns True.

        ``exclude_frozen_parameters=True`` is refused: the per-layer files hold whole layers.

        Example:
            >>> engine.save_checkpoint("ckpt")  # ckpt/global_step<N>/layer_00-model_states.pt, ...
        """
        if exclude_frozen_parameters:
            raise NotImplementedError(
                "save_checkpoint(exclude_frozen_parameters=True) is not implemented for a "
                "PipelineModule: its layer_XX-model_states.pt files hold whole layers"
            )
        client_state = dict(client_state or {})
        check_client_state(client_state)
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        with tag_directory(
            save_dir, tag, rank=self.global_rank, save_latest=save_latest
        ) as partial:
            cast(PipelineModule, self.module).save_state_dict(partial)
            save_fsynced(self._rank_state(client_state), partial / self._state_file())
        return True

    def load_checkpoint(
        self,
        load_dir: str,
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load ``load_dir/tag`` (None: the tag in ``latest``); only the layers with
        ``load_module_only`` (any stage count). ``custom_load_fn`` is refused, as in DeepSpeed
        (a pipeline loads its layers from per-layer files).

        Returns:
            ``(load_path, client_state)``, or ``(None, None)`` when there is nothing to load.
        """
        if custom_load_fn is not None:
            raise NotImplementedError(
                "load_checkpoint(custom_load_fn=...) is not supported with a PipelineModule (as "
                "in DeepSpeed): its layers load from per-layer files"
            )
        ds_path = deepspeed_tag_dir(load_dir, tag)
        if ds_path is not None:  # DeepSpeed wrote it
            return load_deepspeed_pipeline_checkpoint(
                self,
                ds_path,
                strict=load_module_strict,
                optimizer_states=load_optimizer_states,
                lr_scheduler_states=load_lr_scheduler_states,
                module_only=load_module_only,
            )
        path = resolve_checkpoint(load_dir, tag)
        if path is None:
            return None, None
        cast(PipelineModule, self.module).load_state_dir(path, strict=load_module_strict)
        if self.zero is not None and hasattr(self.zero, "refresh_fp32_params"):
            cast(Any, self.zero).refresh_fp32_params()  # not in GradientStep: checked above
        if load_module_only:
            return str(path), {}
        state_file = path / self._state_file()
        if not state_file.is_file():
            raise FileNotFoundError(
                f"{state_file} is missing: the checkpoint was saved with another pipeline or "
                "data-parallel layout; pass load_module_only=True to load only the layers"
            )
        state = torch.load(state_file, map_location="cpu", weights_only=True)
        optim = self.zero if self.zero is not None else self.optimizer
        if load_optimizer_states and optim is not None and state["optimizer"] is not None:
            optim.load_state_dict(state["optimizer"])
        if self.loss_scaler is not None and state["loss_scaler"] is not None:
            self.loss_scaler.load_state_dict(state["loss_scaler"])
        if load_lr_scheduler_states and self.lr_scheduler and state["lr_scheduler"]:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.training_dataloader is not None and state["loader"] is not None:
            self.training_dataloader.load_state_dict(state["loader"])
        self.pipe.global_steps = int(state["global_steps"])
        self.pipe.skipped_steps = int(state["skipped_steps"])
        return str(path), state["client_state"]


install_config_accessors(PipelineDeepSpeedEngine)
