"""``PipelineEngine``: runs a ``PipelineModule``'s schedule, one batch per ``train_batch()``.

[Note: what a pipeline batch does]
``train_batch`` executes this stage's schedule (``_schedule.py``) instruction by instruction.
The first virtual stage takes each micro-batch's inputs from the data iterator and the last one
its labels (DeepSpeed's data iterators yield ``(inputs, labels)``; both stages pull every
micro-batch, so both need an iterator over the same data). The last virtual stage computes
``loss_fn(outputs, labels)`` and backpropagates ``loss * loss_scale / micro_batches``; the other
stages backpropagate the gradients they receive unchanged, so every parameter ends the batch
with the gradient of the mean loss, scaled by the loss scale, as if the batch ran in one process.
The batch ends with the loss exchange (every stage returns the same value): with data or model
replicas, or tied weights, an all-reduce of the last stages' mean losses over all ranks,
averaged over the replicas; otherwise the last stage sends its mean loss to the other stages,
which posted the receive with their first activation send (no collective latency at the end).
Either way every rank waits there on the engine's own group before any collective of another
group (tied weights, data parallelism), which is where a failed stage is noticed (see [Note:
failing every stage] in ``_p2p.py``). Then the tied-weight reduction and the gradient step
(a :class:`ds_optim.GradientStep`: ds-zero's core under ds-engine): backward passes accumulate
with the step's boundary held False, and at the schedule's ``OptimizerStep`` the boundary is set,
the step taken and its :class:`ds_optim.StepResult` kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, cast

import torch

import ds_comm
from ds_comm.accelerator import get_accelerator
from ds_optim import GradientStep, StepResult
from ds_pipe._grad_step import DataParallelStep
from ds_pipe._p2p import (
    PipeChannels,
    PipelineAbortedError,
    as_tensor_tuple,
    is_peer_failure,
    resolve_tagless,
)
from ds_pipe._schedule import (
    BackwardPass,
    ForwardPass,
    InferenceSchedule,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    PipeSchedule,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    build_schedule,
)

__all__ = ["PIPE_TIMER_NAMES", "PipelineEngine", "PipeTimer"]

_REDUCE_OUTPUTS = ("avg", None)

PipeTimer = Callable[[Sequence[str]], AbstractContextManager[Any]]
"""A timer factory: ``timer(names)`` returns a context that times its block under each name."""

# [Note: timing the schedule's instructions]
# With a ``timer`` factory the engine times each instruction under DeepSpeed's pipeline timer
# names: the data load, the forward and backward passes (micro-step and global timers; a
# stage's backward is all autograd, so the inner timers cover the same interval), the four
# point-to-point transfers, the data-parallel gradient reduction (the allreduce timers) and the
# optimizer step. The tied-weight reduction and loss exchange have no DeepSpeed timer.
_TIMERS: dict[type, tuple[str, ...]] = {
    LoadMicroBatch: ("batch_input",),
    ForwardPass: ("fwd_microstep", "fwd"),
    BackwardPass: ("bwd_microstep", "bwd", "bwd_inner_microstep", "bwd_inner"),
    SendActivation: ("pipe_send_output",),
    RecvActivation: ("pipe_recv_input",),
    SendGrad: ("pipe_send_grad",),
    RecvGrad: ("pipe_recv_grad",),
    ReduceGrads: ("bwd_allreduce_microstep", "bwd_allreduce"),
    OptimizerStep: ("step_microstep", "step"),
}
PIPE_TIMER_NAMES: tuple[str, ...] = tuple(n for names in _TIMERS.values() for n in names)
"""Every timer name a ``timer`` factory may be called with (see [Note: timing the schedule's
instructions])."""


@dataclass
class _BatchState:
    """What one batch holds between instructions, keyed by ``(micro_batch, chunk)``."""

    mode: str
    batches: dict[int, Any] = field(default_factory=dict)
    inputs: dict[tuple[int, int], Any] = field(default_factory=dict)
    outputs: dict[tuple[int, int], Any] = field(default_factory=dict)
    grads: dict[tuple[int, int], list[torch.Tensor | None]] = field(default_factory=dict)
    labels: dict[int, Any] = field(default_factory=dict)
    losses: dict[int, Any] = field(default_factory=dict)
    mean_loss: torch.Tensor | None = None
    logits: list[Any] = field(default_factory=list)
    compute_loss: bool = True


@dataclass(frozen=True)
class _Plan:
    """A schedule ready to run: ``(handler, instruction)`` pairs in order, and what each peer
    rank sends this one, in its order (see [Note: one ordered stream per pair of ranks] in
    ``_p2p.py``)."""

    calls: list[tuple[Any, PipeInstruction]]
    incoming: dict[int, tuple[tuple[str, int], ...]]


def _to_device(value: Any, device: torch.device) -> Any:
    if torch.is_tensor(value):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    return value


class PipelineEngine:
    """Trains a ``PipelineModule`` with a pipeline schedule (see [Note: what a pipeline batch
    does]); DeepSpeed's ``PipelineEngine`` surface.

    Every rank of the module's topology constructs the engine (it creates the pipeline's
    process group) and calls ``train_batch``/``eval_batch`` together.

    Args:
        module: the ``PipelineModule`` (this rank's stage).
        optimizer: the torch optimizer over ``module.parameters()``.
        micro_batches: micro-batches per batch (DeepSpeed's gradient accumulation steps).
        schedule: ``'1f1b'`` (default), ``'gpipe'`` or ``'interleaved'`` (needs the module's
            ``num_virtual_stages`` > 1 chunks per stage).
        gradient_clipping: clip the global gradient norm to this (0: off).
        loss_scaler: a ds-optim loss scaler (fp16); overflow skips agree across all ranks.
        lr_scheduler: stepped after every optimizer step that was not skipped.
        grad_step: the :class:`ds_optim.GradientStep` to drive instead of the standalone
            :class:`DataParallelStep` (ds-engine passes ds-zero's gradient-step core); then
            ``gradient_clipping`` and ``loss_scaler`` are the step's business.
        timer: a :data:`PipeTimer` factory timing each instruction under DeepSpeed's names (see
            [Note: timing the schedule's instructions]); None: nothing is timed.

    Attributes:
        global_steps: batches trained (skipped steps included).
        skipped_steps: batches whose optimizer step an fp16 overflow skipped.

    Example:
        >>> engine = PipelineEngine(module, torch.optim.AdamW(module.parameters()), micro_batches=8)
        >>> loss = engine.train_batch(iter(loader))  # the same value on every stage
    """

    def __init__(
        self,
        module: Any,
        optimizer: torch.optim.Optimizer | None,
        *,
        micro_batches: int,
        schedule: str = "1f1b",
        gradient_clipping: float = 0.0,
        loss_scaler: Any = None,
        lr_scheduler: Any = None,
        grad_step: GradientStep | None = None,
        timer: PipeTimer | None = None,
    ) -> None:
        self.module = module
        self.timer = timer
        self.grid = module.grid
        self.stage_id = self.grid.stage_id
        self.num_stages = self.grid.num_stages
        self.num_virtual_stages = int(getattr(module, "num_virtual_stages", 1))
        self.micro_batches = micro_batches
        self.schedule_name = schedule
        self._schedule()  # validates the combination before any collective
        params = list(module.parameters())
        # the stage's device; a stage without parameters uses the accelerator's
        self.device = (
            params[0].device if params else torch.device(get_accelerator().current_device_name())
        )
        world = ds_comm.get_world_size()
        self.group = ds_comm.new_group(ranks=list(range(world)))  # see [Note: failing every stage]
        # Without tags, each direction gets a group (see [Note: one ordered stream per pair of
        # ranks] in _p2p.py); every rank resolves the same mode.
        tagless = resolve_tagless(self.group)
        reverse = ds_comm.new_group(ranks=list(range(world))) if tagless and world > 1 else None
        self.channels = PipeChannels(
            self.group, self._rank_of_chunk, self.device, tagless=tagless, reverse_group=reverse
        )
        # One pipeline without tied weights: the last stage sends the loss to the others, whose
        # receive is posted at the start of the batch, instead of an all-reduce (see [Note: what
        # a pipeline batch does]). Replicas or tie groups need every rank in one collective.
        replicas = self.grid.axis_world_size("data") * self.grid.axis_world_size("model")
        tied_anywhere = any(len(t.ranks) > 1 for t in module.tied_groups().values())
        tied = torch.tensor([float(tied_anywhere)], device=self.device)  # the group's device
        if world > 1:
            ds_comm.all_reduce(tied, op=ds_comm.ReduceOp.MAX, group=self.group)
        self._loss_by_p2p = replicas == 1 and self.num_stages > 1 and not bool(tied.item())
        if reverse is not None:
            self.channels.connect(self._peers())
        if grad_step is None and optimizer is not None:
            grad_step = DataParallelStep(
                params,
                optimizer,
                micro_batches=micro_batches,
                data_group=self.grid.get_group("data"),
                norm_group=self.group,
                norm_exclude=module.tied_params_owned_elsewhere(),
                gradient_clipping=gradient_clipping,
                loss_scaler=loss_scaler,
            )
        self.grad_step: GradientStep | None = grad_step
        if grad_step is not None:  # the schedule, not a count of backward passes, ends a batch
            grad_step.set_gradient_accumulation_boundary(False)
        self.optimizer = (
            optimizer if optimizer is not None else getattr(grad_step, "optimizer", None)
        )
        self.lr_scheduler = lr_scheduler
        self.global_steps = 0
        self.skipped_steps = 0
        self.data_iterator: Iterator[Any] | None = None
        self._state = _BatchState(mode="train")
        self._plans: dict[
            tuple[str, int], _Plan
        ] = {}  # by mode and micro-batches, see [Note: the per-micro-batch path]
        self._dispatch = {
            LoadMicroBatch: self._exec_load,
            ForwardPass: self._exec_forward,
            BackwardPass: self._exec_backward,
            SendActivation: self._exec_send_activation,
            RecvActivation: self._exec_recv_activation,
            SendGrad: self._exec_send_grad,
            RecvGrad: self._exec_recv_grad,
            ReduceTiedGrads: self._exec_reduce_tied_grads,
            ReduceGrads: self._exec_reduce_grads,
            OptimizerStep: self._exec_optimizer_step,
        }

    # --- DeepSpeed's surface ---------------------------------------------------------------------

    def is_first_stage(self) -> bool:
        """True on pipeline stage 0 (which takes the inputs)."""
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        """True on the last stage (which takes the labels and computes the loss)."""
        return self.stage_id == self.num_stages - 1

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """The iterator ``train_batch()`` reads when called without one."""
        self.data_iterator = iterator

    def schedule(self) -> PipeSchedule:
        """This stage's training schedule (printable)."""
        return self._schedule()

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Train on one batch of ``micro_batches`` micro-batches; returns the mean loss.

        Args:
            data_iter: yields ``(inputs, labels)`` micro-batches (needed on the first and last
                stage; becomes the engine's iterator). None: the one from ``set_dataiterator``.

        Returns:
            The mean loss of the batch over micro-batches and data-parallel replicas, a 0-dim
            fp32 tensor equal on every stage.
        """
        if not torch.is_grad_enabled():
            raise RuntimeError(
                "train_batch() needs autograd: it was called under torch.no_grad(); use "
                "eval_batch() for evaluation"
            )
        if self.grad_step is None:
            raise RuntimeError(
                "this PipelineEngine has no optimizer: pass optimizer= (or grad_step=) to train"
            )
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        self._state = _BatchState(mode="train")
        self._run(self._plan("train"))
        self.global_steps += 1
        assert self._state.mean_loss is not None  # set by the schedule's ReduceTiedGrads
        return self._state.mean_loss

    def eval_batch(
        self,
        data_iter: Iterator[Any],
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
    ) -> Any:
        """Forward one batch without gradients (the inference schedule).

        Args:
            data_iter: yields ``(inputs, labels)`` micro-batches (first and last stage).
            return_logits: also return the last stage's outputs, concatenated over the
                micro-batches along dim 0 (None on other stages).
            compute_loss: apply the module's ``loss_fn``; otherwise the outputs take its place.
            reduce_output: ``'avg'``: the mean over micro-batches, broadcast to every stage when
                it is a scalar; None: the list of per-micro-batch values on the last stage.

        Returns:
            The reduced loss (or outputs), and the logits when ``return_logits``.
        """
        if reduce_output not in _REDUCE_OUTPUTS:
            raise ValueError(f"reduce_output = {reduce_output!r}: expected 'avg' or None")
        saved_iter, was_training = self.data_iterator, self.module.training
        self.data_iterator = data_iter
        self.module.eval()
        self.channels.forget("eval")  # each evaluation may use its own micro-batch shapes
        self._state = _BatchState(mode="eval", compute_loss=compute_loss)
        try:
            with torch.no_grad():
                self._run(self._plan("eval"))
                result = self._reduce_eval(reduce_output)
        finally:
            self.data_iterator = saved_iter
            self.module.train(was_training)
        if not return_logits:
            return result
        logits = self._state.logits
        return result, (torch.cat(logits) if logits else None)

    def get_lr(self) -> list[float]:
        """The learning rate of each param group."""
        if self.optimizer is None:
            return []
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    @property
    def last_step(self) -> StepResult | None:
        """What the gradient step did at the end of the last ``train_batch`` (None before)."""
        return self.grad_step.last_result if self.grad_step is not None else None

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last step (every stage and replica; see
        [Note: the global gradient norm of a pipeline]); None when the step did not need it
        (no clipping and no loss scaler)."""
        return self.last_step.grad_norm if self.last_step is not None else None

    # --- execution -------------------------------------------------------------------------------

    def _schedule(self) -> PipeSchedule:
        return build_schedule(
            self.schedule_name,
            micro_batches=self.micro_batches,
            stages=self.num_stages,
            stage_id=self.stage_id,
            virtual_stages=self.num_virtual_stages,
        )

    def _rank_of_chunk(self, chunk: int) -> int:
        return self.grid.stage_to_global(chunk % self.num_stages)

    @property
    def _holds_last_chunk(self) -> bool:
        return self.stage_id == self.num_stages - 1

    @property
    def _last_chunk(self) -> int:
        return self.num_stages * self.num_virtual_stages - 1

    def _plan(self, mode: str) -> _Plan:
        """The schedule of ``mode`` (``'train'`` or ``'eval'``) flattened into handler calls,
        with the receives it makes per channel; built once (see [Note: the per-micro-batch
        path])."""
        key = (mode, self.micro_batches)  # a public attribute: a changed one gets its own plan
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        schedule = self._schedule_of(mode, self.stage_id)
        calls = [(self._dispatch[type(cmd)], cmd) for cmd in schedule.instructions()]
        plan = self._plans[key] = _Plan(calls, self._incoming(mode))
        return plan

    def _schedule_of(self, mode: str, stage: int) -> PipeSchedule:
        if mode == "train":
            return build_schedule(
                self.schedule_name,
                micro_batches=self.micro_batches,
                stages=self.num_stages,
                stage_id=stage,
                virtual_stages=self.num_virtual_stages,
            )
        return InferenceSchedule(
            self.micro_batches, self.num_stages, stage, self.num_virtual_stages
        )

    def _incoming(self, mode: str) -> dict[int, tuple[tuple[str, int], ...]]:
        """What each other stage's rank sends this rank in a batch of ``mode``, in its send
        order: its schedule's sends aimed at this stage, then the loss (see [Note: one ordered
        stream per pair of ranks] in ``_p2p.py``)."""
        me, stages = self.stage_id, self.num_stages
        incoming = {}
        for stage in range(stages):
            if stage == me:
                continue
            keys: list[tuple[str, int]] = []
            for cmd in self._schedule_of(mode, stage).instructions():
                if isinstance(cmd, SendActivation) and (cmd.chunk_id + 1) % stages == me:
                    keys.append(("act", cmd.chunk_id + 1))
                elif isinstance(cmd, SendGrad) and (cmd.chunk_id - 1) % stages == me:
                    keys.append(("grad", cmd.chunk_id - 1))
            src = self.grid.stage_to_global(stage)
            if mode == "train" and self._loss_by_p2p and stage == stages - 1:
                keys.append(("loss", src))  # sent after the schedule, by ReduceTiedGrads
            if keys:
                incoming[src] = tuple(keys)
        return incoming

    def _run(self, plan: _Plan) -> None:
        cmd: PipeInstruction | None = None
        try:
            self.channels.start_batch(self._state.mode, plan.incoming)
            timer = self.timer
            for handler, cmd in plan.calls:
                names = _TIMERS.get(type(cmd)) if timer is not None else None
                if names:
                    assert timer is not None
                    with timer(names):
                        handler(cmd)
                else:
                    handler(cmd)
            self.channels.wait_sends()
        except BaseException as exc:
            self.channels.abort()
            if is_peer_failure(exc):
                where = self._where(cmd) if cmd is not None else f"pipeline stage {self.stage_id}"
                raise PipelineAbortedError(
                    f"{where} ({cmd}): another rank of the pipeline failed, so this batch was "
                    "aborted on every rank; the cause is in the traceback of the rank that "
                    f"raised first (here: {exc})"
                ) from exc
            raise

    def _peers(self) -> list[int]:
        """The ranks this rank exchanges point-to-point messages with."""
        last = self._last_chunk
        chunks = [self.stage_id + k * self.num_stages for k in range(self.num_virtual_stages)]
        peers = {self._rank_of_chunk(c + d) for c in chunks for d in (-1, 1) if 0 <= c + d <= last}
        if self._loss_by_p2p:  # the last stage sends every other stage the loss
            if self._holds_last_chunk:
                peers.update(self.grid.stage_to_global(s) for s in range(self.num_stages - 1))
            else:
                peers.add(self._rank_of_chunk(last))
        peers.discard(ds_comm.get_rank())
        return sorted(peers)

    def _where(self, cmd: PipeInstruction) -> str:
        chunk = getattr(cmd, "chunk_id", self.stage_id)
        mb = getattr(cmd, "micro_batch_id", None)
        virtual = f" (virtual stage {chunk})" if self.num_virtual_stages > 1 else ""
        return f"pipeline stage {self.stage_id}{virtual}, micro-batch {mb}"

    def _exec_load(self, cmd: LoadMicroBatch) -> None:
        state, mb = self._state, cmd.micro_batch_id
        if mb not in state.batches:
            if self.data_iterator is None:
                raise RuntimeError(
                    f"{self._where(cmd)} loads data but has no data iterator: pass data_iter to "
                    "train_batch()/eval_batch() (or call set_dataiterator) on the first and "
                    "last stages"
                )
            batch = next(self.data_iterator)
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise TypeError(
                    f"{self._where(cmd)}: the data iterator yielded a {type(batch).__name__}; "
                    "pipeline data iterators yield (inputs, labels) pairs"
                )
            state.batches[mb] = _to_device(tuple(batch), self.device)
        inputs, labels = state.batches[mb]
        if cmd.chunk_id == 0:
            state.inputs[(mb, 0)] = inputs
        if cmd.chunk_id == self._last_chunk:
            state.labels[mb] = labels

    def _exec_forward(self, cmd: ForwardPass) -> None:
        state, key = self._state, (cmd.micro_batch_id, cmd.chunk_id)
        inputs = state.inputs[key]
        if self.num_virtual_stages > 1:
            outputs = self.module(inputs, chunk_id=cmd.chunk_id)
        else:
            outputs = self.module(inputs)
        if cmd.chunk_id != self._last_chunk:
            state.outputs[key] = outputs
            return
        labels = state.labels.pop(cmd.micro_batch_id)
        loss_fn = self.module.loss_fn
        if state.mode == "eval":
            state.logits.append(outputs)
            value = loss_fn(outputs, labels) if state.compute_loss and loss_fn else outputs
            state.losses[cmd.micro_batch_id] = value
            return
        loss = loss_fn(outputs, labels) if loss_fn is not None else outputs
        if not (torch.is_tensor(loss) and loss.numel() == 1):
            raise TypeError(
                f"{self._where(cmd)}: the loss is {type(loss).__name__}"
                f"{list(loss.shape) if torch.is_tensor(loss) else ''}; train_batch needs a "
                "scalar tensor (give PipelineModule a loss_fn, or make the last layer return one)"
            )
        state.outputs[key] = loss

    def _exec_backward(self, cmd: BackwardPass) -> None:
        state, key = self._state, (cmd.micro_batch_id, cmd.chunk_id)
        assert self.grad_step is not None  # train_batch() checked it
        outputs = state.outputs.pop(key)
        if cmd.chunk_id == self._last_chunk:
            state.losses[cmd.micro_batch_id] = outputs.detach().reshape(())
            self.grad_step.backward(outputs)
        else:
            grads = state.grads.pop(key)
            # the gradient came back: the output was received, its send buffer can go
            self.channels.release(cmd.chunk_id, cmd.micro_batch_id)
            pairs = [(o, g) for o, g in zip(as_tensor_tuple(outputs, ""), grads) if g is not None]
            if pairs:
                self.grad_step.backward([o for o, _ in pairs], grad_tensors=[g for _, g in pairs])
        if cmd.chunk_id == 0:
            state.inputs.pop(key)

    def _exec_send_activation(self, cmd: SendActivation) -> None:
        state, key = self._state, (cmd.micro_batch_id, cmd.chunk_id)
        outputs = state.outputs[key] if state.mode == "train" else state.outputs.pop(key)

        def where() -> str:  # only built for an error
            return f"{self._where(cmd)}, output of layer {self.module.parts[cmd.chunk_id + 1] - 1}"

        mb = cmd.micro_batch_id if state.mode == "train" else None
        self.channels.send_activation(outputs, cmd.chunk_id, state.mode, where, mb)

    def _exec_recv_activation(self, cmd: RecvActivation) -> None:
        key = (cmd.micro_batch_id, cmd.chunk_id)
        self._state.inputs[key] = self.channels.recv_activation(cmd.chunk_id, self._state.mode)

    def _exec_send_grad(self, cmd: SendGrad) -> None:
        inputs = self._state.inputs.pop((cmd.micro_batch_id, cmd.chunk_id))
        self.channels.send_grads(as_tensor_tuple(inputs, ""), cmd.chunk_id)

    def _exec_recv_grad(self, cmd: RecvGrad) -> None:
        key = (cmd.micro_batch_id, cmd.chunk_id)
        outputs = as_tensor_tuple(self._state.outputs[key], "")
        self._state.grads[key] = self.channels.recv_grads(outputs, cmd.chunk_id)

    def _exec_reduce_tied_grads(self, cmd: ReduceTiedGrads) -> None:
        # The loss exchange first: before any collective of another group (see [Note: what a
        # pipeline batch does]).
        losses = list(self._state.losses.values())
        mine = torch.stack(losses).float().mean() if losses else torch.zeros((), device=self.device)
        if not self._loss_by_p2p:
            self.channels.wait_sends()
            self._state.mean_loss = self._all_mean(mine, bool(losses))
        elif self._holds_last_chunk:
            others = [self.grid.stage_to_global(s) for s in range(self.num_stages - 1)]
            self.channels.send_loss(mine.detach().to(self.device), others)
            self._state.mean_loss = mine.detach()
        else:
            src = self._rank_of_chunk(self._last_chunk)
            self._state.mean_loss = self.channels.take_loss(src).clone()
        self.module.allreduce_tied_weight_gradients()

    def _exec_reduce_grads(self, cmd: ReduceGrads) -> None:
        assert self.grad_step is not None  # train_batch() checked it
        self.grad_step.reduce_gradients()

    def _exec_optimizer_step(self, cmd: OptimizerStep) -> None:
        step = self.grad_step
        assert step is not None  # train_batch() checked it
        step.set_gradient_accumulation_boundary(True)
        try:
            result = step.step()
        finally:
            step.set_gradient_accumulation_boundary(False)
        if result.skipped:
            self.skipped_steps += 1
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def _all_mean(self, value: torch.Tensor, contributes: bool) -> torch.Tensor:
        """The mean of ``value`` over the ranks that contribute, known on every rank."""
        count = torch.tensor(float(contributes), dtype=torch.float64, device=self.device)
        packed = torch.stack([value.detach().double().reshape(()).to(self.device), count])
        if ds_comm.get_world_size(self.group) > 1:
            ds_comm.all_reduce(packed, group=self.group)
        return (packed[0] / packed[1].clamp(min=1.0)).float()

    def _reduce_eval(self, reduce_output: str | None) -> Any:
        values = [self._state.losses[mb] for mb in sorted(self._state.losses)]
        if reduce_output is None:
            return values if values else None
        mean = None
        if values and all(torch.is_tensor(v) for v in values):
            mean = torch.stack([v.float() for v in values]).mean(0)
        scalar = mean is not None and mean.numel() == 1
        # every rank must agree on whether to broadcast: only scalar losses are
        if self.module.loss_fn is not None and self._state.compute_loss:
            return self._all_mean(
                cast(torch.Tensor, mean).reshape(()) if scalar else torch.zeros(()), scalar
            )
        return mean
