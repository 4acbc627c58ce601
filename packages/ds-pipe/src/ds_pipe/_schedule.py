"""Pipeline schedules: the per-stage order of loads, passes, transfers and the optimizer step.

[Note: schedules are plain instruction lists]
A schedule is built for one stage and yields, step by step, a list of small frozen instructions
(``ForwardPass(micro_batch_id=3, chunk_id=1)``); the engine executes them in order. Printing a
schedule prints what the stage will do, and tests check the lists directly: every micro-batch
goes forward and backward once per chunk, every send has the matching receive on the
neighbour, and no stage holds more micro-batches than the schedule promises.

``chunk_id`` is the *virtual stage* the instruction runs: ``stage_id + k * num_stages`` for the
``k``-th chunk of a stage (the same numbering as ``PipelineModule.chunk_ids()``); without
interleaving it is the stage id. Activations flow from virtual stage ``c`` to ``c + 1`` (the last
stage's chunk ``c`` feeds the first stage's chunk ``c + 1``), gradients the other way.

[Note: why the order is deadlock-free]
Unlike DeepSpeed, whose stages pair blocking sends and receives in lock step (even stages send
first, odd ones receive first), the engine posts every send without waiting and blocks only on
receives, and each rank posts its receives from a peer in that peer's send order (see [Note: one
ordered stream per pair of ranks] in ``_p2p.py``), so messages match by channel, in order, with
or without tags. A stage then waits only for work its neighbour has already scheduled before
that neighbour waits on it: 1F1B, GPipe and the interleaved order are topological orders of the
micro-batch dependency graph. ``simulate()`` in the tests executes all stages' lists under exactly
these rules and fails on a cycle.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

__all__ = [
    "BackwardPass",
    "ForwardPass",
    "GPipeSchedule",
    "InferenceSchedule",
    "InterleavedSchedule",
    "LoadMicroBatch",
    "OptimizerStep",
    "PipeInstruction",
    "PipeSchedule",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTiedGrads",
    "SendActivation",
    "SendGrad",
    "TrainSchedule",
    "build_schedule",
]


@dataclass(frozen=True)
class PipeInstruction:
    """One thing a stage does; subclasses name it. Batch-level ones carry no micro-batch."""

    def __str__(self) -> str:
        return type(self).__name__


@dataclass(frozen=True)
class _MicroBatchInstruction(PipeInstruction):
    micro_batch_id: int
    chunk_id: int = 0

    def __str__(self) -> str:
        return f"{type(self).__name__}(mb={self.micro_batch_id}, chunk={self.chunk_id})"


@dataclass(frozen=True)
class LoadMicroBatch(_MicroBatchInstruction):
    """Take the micro-batch's inputs (first virtual stage) or labels (last) from the data."""


@dataclass(frozen=True)
class ForwardPass(_MicroBatchInstruction):
    """Run the chunk's layers on the micro-batch (and the loss on the last virtual stage)."""


@dataclass(frozen=True)
class BackwardPass(_MicroBatchInstruction):
    """Backpropagate the micro-batch through the chunk."""


@dataclass(frozen=True)
class SendActivation(_MicroBatchInstruction):
    """Send the chunk's output to virtual stage ``chunk_id + 1``."""


@dataclass(frozen=True)
class RecvActivation(_MicroBatchInstruction):
    """Receive the chunk's input from virtual stage ``chunk_id - 1``."""


@dataclass(frozen=True)
class SendGrad(_MicroBatchInstruction):
    """Send the gradient of the chunk's input to virtual stage ``chunk_id - 1``."""


@dataclass(frozen=True)
class RecvGrad(_MicroBatchInstruction):
    """Receive the gradient of the chunk's output from virtual stage ``chunk_id + 1``."""


@dataclass(frozen=True)
class ReduceTiedGrads(PipeInstruction):
    """Sum tied weights' gradients over their tie groups."""


@dataclass(frozen=True)
class ReduceGrads(PipeInstruction):
    """Reduce gradients over the data-parallel replicas."""


@dataclass(frozen=True)
class OptimizerStep(PipeInstruction):
    """Norm, clipping, overflow check and the optimizer and LR schedule steps."""


Step = list[PipeInstruction]


class PipeSchedule:
    """The instructions one stage runs for one batch of ``micro_batches``.

    Args:
        micro_batches: micro-batches per batch (gradient accumulation steps).
        stages: pipeline stages.
        stage_id: the stage this schedule is for.
        virtual_stages: chunks per stage (interleaving); 1 otherwise.

    Iterating yields one list of instructions per step; ``str(schedule)`` prints them.
    """

    def __init__(
        self, micro_batches: int, stages: int, stage_id: int, virtual_stages: int = 1
    ) -> None:
        for name, value in (
            ("micro_batches", micro_batches),
            ("stages", stages),
            ("virtual_stages", virtual_stages),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} = {value!r}: expected a positive integer")
        if not 0 <= stage_id < stages:
            raise ValueError(f"stage_id = {stage_id!r}: expected 0 <= stage_id < {stages}")
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.virtual_stages = virtual_stages

    @property
    def num_chunks(self) -> int:
        """Virtual stages of the whole pipeline."""
        return self.stages * self.virtual_stages

    def chunk_ids(self) -> list[int]:
        """The virtual stages this stage runs."""
        return [self.stage_id + k * self.stages for k in range(self.virtual_stages)]

    def steps(self) -> Iterator[Step]:
        """Yield the instruction list of each step."""
        raise NotImplementedError

    def __iter__(self) -> Iterator[Step]:
        return self.steps()

    def instructions(self) -> list[PipeInstruction]:
        """All instructions of the batch, flattened."""
        return [cmd for step in self.steps() for cmd in step]

    def num_pipe_buffers(self) -> int:
        """The most micro-batches whose activations this stage holds at once (per chunk set)."""
        live = peak = 0
        for cmd in self.instructions():
            if isinstance(cmd, ForwardPass):
                live += 1
                peak = max(peak, live)
            elif isinstance(cmd, BackwardPass):
                live -= 1
        return peak

    def __str__(self) -> str:
        lines = [
            f"{type(self).__name__}(micro_batches={self.micro_batches}, stages={self.stages}, "
            f"stage_id={self.stage_id}, virtual_stages={self.virtual_stages})"
        ]
        for i, step in enumerate(self.steps()):
            lines.append(f"  step {i:3d}: " + "; ".join(str(cmd) for cmd in step))
        return "\n".join(lines)

    # --- building blocks ------------------------------------------------------------------------

    def _forward(self, mb: int, chunk: int) -> Step:
        cmds: Step = []
        if chunk > 0:
            cmds.append(RecvActivation(mb, chunk))
        if chunk in (0, self.num_chunks - 1):
            cmds.append(LoadMicroBatch(mb, chunk))
        cmds.append(ForwardPass(mb, chunk))
        if chunk < self.num_chunks - 1:
            cmds.append(SendActivation(mb, chunk))
        return cmds

    def _backward(self, mb: int, chunk: int) -> Step:
        cmds: Step = []
        if chunk < self.num_chunks - 1:
            cmds.append(RecvGrad(mb, chunk))
        cmds.append(BackwardPass(mb, chunk))
        if chunk > 0:
            cmds.append(SendGrad(mb, chunk))
        return cmds

    @staticmethod
    def _with_step(steps: list[Step]) -> Iterator[Step]:
        """Append the batch-level gradient instructions to the last step."""
        for i, step in enumerate(steps):
            if i == len(steps) - 1:
                step = [*step, ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
            yield step


class TrainSchedule(PipeSchedule):
    """1F1B (PipeDream-flush), DeepSpeed's default: ``stages - stage_id - 1`` warm-up forwards,
    then one forward and one backward in turn, then the remaining backwards.

    A stage holds at most ``stages - stage_id`` micro-batches (<= ``stages``), against GPipe's
    ``micro_batches``; the bubble is the same, ``(p - 1) / (m + p - 1)``.

    Example:
        >>> print(TrainSchedule(micro_batches=4, stages=2, stage_id=1))
    """

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        super().__init__(micro_batches, stages, stage_id)

    def steps(self) -> Iterator[Step]:
        m, s = self.micro_batches, self.stage_id
        warmup = min(self.stages - s - 1, m)
        steps = [self._forward(mb, s) for mb in range(warmup)]
        for i in range(m - warmup):
            steps.append(self._forward(warmup + i, s))
            steps.append(self._backward(i, s))
        steps += [self._backward(mb, s) for mb in range(m - warmup, m)]
        yield from self._with_step(steps)


class GPipeSchedule(PipeSchedule):
    """GPipe fill-drain: every forward, then every backward (holds all micro-batches)."""

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        super().__init__(micro_batches, stages, stage_id)

    def steps(self) -> Iterator[Step]:
        m, s = self.micro_batches, self.stage_id
        steps = [self._forward(mb, s) for mb in range(m)]
        steps += [self._backward(mb, s) for mb in range(m)]
        yield from self._with_step(steps)


class InterleavedSchedule(PipeSchedule):
    """Interleaved 1F1B (Megatron-LM): each stage runs ``virtual_stages`` chunks, which cuts
    the bubble to ``(p - 1) / (v * m + p - 1)`` of the batch at the cost of more transfers.

    Micro-batches go through the chunks in groups of ``stages``; ``micro_batches`` must be a
    multiple of ``stages``. Warm-up is ``2 * (p - s - 1) + (v - 1) * p`` chunk-forwards.

    Example:
        >>> InterleavedSchedule(micro_batches=4, stages=2, stage_id=0, virtual_stages=2)
    """

    def __init__(self, micro_batches: int, stages: int, stage_id: int, virtual_stages: int) -> None:
        super().__init__(micro_batches, stages, stage_id, virtual_stages)
        if virtual_stages > 1 and micro_batches % stages:
            raise ValueError(
                f"micro_batches = {micro_batches}: the interleaved schedule needs a multiple of "
                f"the {stages} stages; use {stages * max(1, round(micro_batches / stages))} or "
                "set schedule='1f1b'"
            )

    def _unit(self, i: int, forward: bool) -> tuple[int, int]:
        """(micro-batch, chunk) of this stage's ``i``-th chunk-forward (or -backward)."""
        p, v = self.stages, self.virtual_stages
        k = (i % (p * v)) // p
        if not forward:
            k = v - 1 - k
        mb = (i // (p * v)) * p + i % p
        return mb, self.stage_id + k * p

    def steps(self) -> Iterator[Step]:
        p, v, s = self.stages, self.virtual_stages, self.stage_id
        total = self.micro_batches * v
        # With one chunk this is plain 1F1B; with several, a stage must run ahead further
        # before its first backward arrives (Megatron-LM's warm-up count).
        warmup = min(p - s - 1 if v == 1 else 2 * (p - s - 1) + (v - 1) * p, total)
        steps = [self._forward(*self._unit(i, True)) for i in range(warmup)]
        for i in range(total - warmup):
            steps.append(self._forward(*self._unit(warmup + i, True)))
            steps.append(self._backward(*self._unit(i, False)))
        steps += [self._backward(*self._unit(i, False)) for i in range(total - warmup, total)]
        yield from self._with_step(steps)


class InferenceSchedule(PipeSchedule):
    """Forward only (``eval_batch``): each micro-batch through this stage's chunks in order."""

    def steps(self) -> Iterator[Step]:
        for mb in range(self.micro_batches):
            for chunk in self.chunk_ids():
                yield self._forward(mb, chunk)


_SCHEDULES = ("1f1b", "gpipe", "interleaved")


def build_schedule(
    name: str, *, micro_batches: int, stages: int, stage_id: int, virtual_stages: int = 1
) -> PipeSchedule:
    """The training schedule called ``name`` (``'1f1b'``, ``'gpipe'`` or ``'interleaved'``).

    Example:
        >>> build_schedule("gpipe", micro_batches=8, stages=4, stage_id=0)
    """
    key = str(name).lower()
    if key not in _SCHEDULES:
        raise ValueError(f"schedule = {name!r}: expected one of {', '.join(_SCHEDULES)}")
    if key != "interleaved" and virtual_stages != 1:
        raise ValueError(
            f"schedule = {name!r} with {virtual_stages} virtual stages per stage: only "
            "schedule='interleaved' runs several chunks per stage; use it, or build the "
            "PipelineModule with num_virtual_stages=1"
        )
    if key == "1f1b":
        return TrainSchedule(micro_batches, stages, stage_id)
    if key == "gpipe":
        return GPipeSchedule(micro_batches, stages, stage_id)
    return InterleavedSchedule(micro_batches, stages, stage_id, virtual_stages)
