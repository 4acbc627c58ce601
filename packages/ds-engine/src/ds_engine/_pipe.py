"""``initialize()`` for a ``PipelineModule``: ds-pipe's engine configured by a DeepSpeed config.

[Note: the pipeline engine under initialize()]
DeepSpeed's ``PipelineEngine`` subclasses its engine; here :class:`PipelineDeepSpeedEngine`
composes ``ds_pipe.PipelineEngine`` with what the config says: the batch-size triad (the number
of micro-batches per ``train_batch`` is ``gradient_accumulation_steps``; the data-parallel size
is the module topology's ``data`` axis), the optimizer and LR schedule (config sections or the
client's), fp16/bf16 (the module is cast; fp16 gets the ``fp16`` section's loss scaler),
``gradient_clipping`` (the global norm over every stage and replica), and checkpoints.

ZeRO: stage 1 runs through :class:`ZeroStage1Step`, a ``ds_pipe.GradientStep`` over
``ds_zero.ZeroOptimizer``: every micro-batch's backward accumulates locally, the tied-weight
gradients are summed, and ``ZeroOptimizer.step()`` then reduce-scatters, takes the norm over the
data group and the pipeline group (``norm_group``, tied copies excluded) and steps the sharded
optimizer. Stages 2 and 3 are refused as in DeepSpeed: they reduce (and shard) gradients in every
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
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

import ds_comm
from ds_engine import __version__
from ds_engine._accessors import ConfigAccessors
from ds_engine._checkpoint import check_client_state, resolve_checkpoint, tag_directory
from ds_engine._loader import DeepSpeedDataLoader
from ds_engine.api import ConfigError, DeepSpeedConfig
from ds_optim import build_loss_scaler, build_lr_scheduler, build_optimizer
from ds_pipe import PipelineEngine, StepResult
from ds_zero import ZeroOptimizer, save_fsynced

__all__ = ["PipelineDeepSpeedEngine", "ZeroStage1Step", "check_pipeline_config"]

_LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}


def check_pipeline_config(config: DeepSpeedConfig) -> None:
    """Refuse what a pipeline cannot train with (see [Note: the pipeline engine under
    initialize()])."""
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


class ZeroStage1Step:
    """A ``ds_pipe.GradientStep`` over a stage-1 ``ds_zero.ZeroOptimizer``: backward passes
    accumulate locally; ``step()`` reduces, clips by the pipeline-wide norm and steps.

    Args:
        zero: the ZeRO optimizer over this stage's parameters, built with the data-parallel
            group, ``gradient_accumulation_steps`` = micro-batches, ``norm_group`` = the
            pipeline group and ``norm_exclude`` = the module's ``tied_params_owned_elsewhere()``.
    """

    def __init__(self, zero: ZeroOptimizer) -> None:
        self.zero = zero
        self.optimizer = zero.optimizer
        # Off the boundary, backward keeps gradients local: tied weights are summed over
        # their tie group first, and step() reduces what is left unreduced.
        zero.set_gradient_accumulation_boundary(False)

    @property
    def loss_scale(self) -> float:
        return self.zero.loss_scale

    def backward(
        self, tensors: Sequence[torch.Tensor], grad_tensors: Sequence[torch.Tensor] | None = None
    ) -> None:
        if grad_tensors is None:
            (loss,) = tensors
            self.zero.backward(loss)
        else:
            self.zero.backward(list(tensors), grad_tensors=list(grad_tensors))

    def reduce_gradients(self) -> None:
        """Deferred: ``ZeroOptimizer.step()`` reduces the gradients backward left local."""

    def step(self) -> StepResult:
        self.zero.set_gradient_accumulation_boundary(True)
        try:
            skipped = self.zero.step()
        finally:
            self.zero.set_gradient_accumulation_boundary(False)
        norm = self.zero.get_global_grad_norm()
        return StepResult(skipped=bool(skipped), grad_norm=None if norm is None else float(norm))


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


class PipelineDeepSpeedEngine(ConfigAccessors):
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
    ) -> None:
        check_pipeline_config(config)
        self.module, self.config = module, config
        self.grid = module.grid
        self.dp_rank = self.grid.axis_rank("data")
        self.dp_world_size = self.grid.axis_world_size("data")
        self.global_rank = ds_comm.get_rank()
        self.low = _LOW.get(config.param_dtype_name)
        if self.low is not None:
            module.to(self.low)
        self.loss_scaler = build_loss_scaler(config.fp16) if config.fp16.enabled else None
        client = self._client_optimizer(optimizer, model_parameters)
        grad_step = None
        self.zero: ZeroOptimizer | None = None
        # ZeRO stage 1 shards the optimizer state; fp16/bf16 need its fp32 master weights (a
        # plain optimizer would step the 16-bit parameters themselves), at stage 0 too.
        if client is not None and (config.zero_optimization.stage == 1 or self.low is not None):
            self.zero = ZeroOptimizer(
                module,
                client,
                config.zero_optimization,
                group=self.grid.get_group("data"),
                loss_scaler=self.loss_scaler,
                gradient_accumulation_steps=config.gradient_accumulation_steps,
                gradient_clipping=config.gradient_clipping,
                norm_group=self.grid.get_group("pipe"),
                norm_exclude=module.tied_params_owned_elsewhere(),
            )
            grad_step = ZeroStage1Step(self.zero)
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
            grad_step=grad_step,
        )
        self.training_dataloader: DeepSpeedDataLoader | None = None
        if training_data is not None:
            self.training_dataloader = DeepSpeedDataLoader(
                training_data,
                batch_size=config.train_micro_batch_size_per_gpu,
                dp_rank=self.dp_rank,
                dp_world_size=self.dp_world_size,
                collate_fn=collate_fn,
                seed=config.seed if config.seed is not None else 0,
            )
            self.set_dataiterator(_repeat(self.training_dataloader))

    def _client_optimizer(self, optimizer: Any, model_parameters: Any) -> Any:
        section = self.config.optimizer
        if optimizer is not None and section is not None:
            raise ConfigError(
                "optimizer: both a client optimizer and an 'optimizer' config section were "
                "given; remove one of them"
            )
        params = model_parameters if model_parameters is not None else self.module.parameters()
        if isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        if callable(optimizer):
            return optimizer(params)
        if section is None:
            return None
        return build_optimizer(section, params, group=self.grid.get_group("data"))

    def _scheduler(self, lr_scheduler: Any) -> Any:
        if lr_scheduler is not None and self.config.scheduler is not None:
            raise ConfigError(
                "scheduler: both a client lr_scheduler and a 'scheduler' config section were "
                "given; remove one of them"
            )
        if self.optimizer is None:
            return None
        if lr_scheduler is not None:
            if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
                return lr_scheduler(self.optimizer)
            return lr_scheduler
        if self.config.scheduler is None:
            return None
        return build_lr_scheduler(self.config.scheduler, self.optimizer)

    # --- the pipeline surface ------------------------------------------------------------------

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Train on ``gradient_accumulation_steps`` micro-batches; the mean loss on every stage."""
        return self.pipe.train_batch(self._cast(data_iter))

    def eval_batch(
        self,
        data_iter: Iterator[Any],
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
    ) -> Any:
        """Forward one batch without gradients (see ``ds_pipe.PipelineEngine.eval_batch``)."""
        return self.pipe.eval_batch(
            self._cast(data_iter), return_logits, compute_loss, reduce_output
        )

    def is_first_stage(self) -> bool:
        return self.pipe.is_first_stage()

    def is_last_stage(self) -> bool:
        return self.pipe.is_last_stage()

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        self.pipe.set_dataiterator(self._cast(iterator))

    def _cast(self, data_iter: Iterator[Any] | None) -> Iterator[Any] | None:
        """fp16/bf16: floating-point inputs cast to the parameters' dtype (labels as given),
        as DeepSpeed's pipeline engine does."""
        if data_iter is None or self.low is None:
            return data_iter
        return ((_to_dtype(inputs, self.low), labels) for inputs, labels in data_iter)

    @property
    def global_steps(self) -> int:
        """Batches trained (skipped fp16 steps included)."""
        return self.pipe.global_steps

    @property
    def skipped_steps(self) -> int:
        return self.pipe.skipped_steps

    @property
    def global_samples(self) -> int:
        return self.pipe.global_steps * self.config.train_batch_size

    def get_lr(self) -> list[float]:
        """The learning rate of each param group."""
        return self.pipe.get_lr()

    def get_global_grad_norm(self) -> float | None:
        """The last step's gradient norm over every stage and replica."""
        return self.pipe.get_global_grad_norm()

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
    ) -> bool:
        """Save the layers and every rank's state to ``save_dir/tag`` atomically; returns True.

        Example:
            >>> engine.save_checkpoint("ckpt")  # ckpt/global_step<N>/layer_00-model_states.pt, ...
        """
        client_state = dict(client_state or {})
        check_client_state(client_state)
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        with tag_directory(
            save_dir, tag, rank=self.global_rank, save_latest=save_latest
        ) as partial:
            self.module.save_state_dict(partial)
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
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Load ``load_dir/tag`` (None: the tag in ``latest``); only the layers with
        ``load_module_only`` (any stage count).

        Returns:
            ``(load_path, client_state)``, or ``(None, None)`` when there is nothing to load.
        """
        path = resolve_checkpoint(load_dir, tag)
        if path is None:
            return None, None
        self.module.load_state_dir(path, strict=load_module_strict)
        if self.zero is not None:
            self.zero.refresh_fp32_params()
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
