"""Pipeline parallelism: PipelineModule, LayerSpec, schedules, pipeline engine."""

from __future__ import annotations

from ds_optim import GradientStep, StepResult
from ds_pipe._engine import PIPE_TIMER_NAMES, PipelineEngine, PipeTimer
from ds_pipe._grad_step import DataParallelStep
from ds_pipe._layer_checkpoint import layer_checkpoint_name, load_layers_into
from ds_pipe._module import PipelineModule, TiedGroup, checkpoint_non_reentrant
from ds_pipe._p2p import PipelineAbortedError
from ds_pipe._partition import (
    count_layer_params,
    format_partition,
    partition_balanced,
    partition_layers,
    partition_uniform,
)
from ds_pipe._schedule import (
    BackwardPass,
    ForwardPass,
    GPipeSchedule,
    InferenceSchedule,
    InterleavedSchedule,
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
    TrainSchedule,
    build_schedule,
)
from ds_pipe._spec import LayerSpec, TiedLayerSpec

__version__ = "0.3.0"

__all__ = [
    # module
    "PipelineModule",
    "LayerSpec",
    "TiedLayerSpec",
    "TiedGroup",
    "checkpoint_non_reentrant",
    # partitioning
    "partition_layers",
    "partition_uniform",
    "partition_balanced",
    "count_layer_params",
    "format_partition",
    # per-layer checkpoints
    "layer_checkpoint_name",
    "load_layers_into",
    # engine
    "PipelineEngine",
    "PipeTimer",
    "PIPE_TIMER_NAMES",
    "GradientStep",
    "DataParallelStep",
    "StepResult",
    "PipelineAbortedError",
    # schedules
    "PipeSchedule",
    "TrainSchedule",
    "GPipeSchedule",
    "InterleavedSchedule",
    "InferenceSchedule",
    "build_schedule",
    "PipeInstruction",
    "LoadMicroBatch",
    "ForwardPass",
    "BackwardPass",
    "SendActivation",
    "RecvActivation",
    "SendGrad",
    "RecvGrad",
    "ReduceTiedGrads",
    "ReduceGrads",
    "OptimizerStep",
    "__version__",
]
