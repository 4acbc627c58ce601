"""``deepspeed.runtime.pipe.schedule``: pipeline schedules and their instructions (ds-pipe)."""

from __future__ import annotations

from ds_engine._optional import require

_pipe = require("ds_pipe", "ds-pipe", "deepspeed.runtime.pipe.schedule")

PipeSchedule = _pipe.PipeSchedule
TrainSchedule = _pipe.TrainSchedule
InferenceSchedule = _pipe.InferenceSchedule
PipeInstruction = _pipe.PipeInstruction
LoadMicroBatch = _pipe.LoadMicroBatch
ForwardPass = _pipe.ForwardPass
BackwardPass = _pipe.BackwardPass
SendActivation = _pipe.SendActivation
RecvActivation = _pipe.RecvActivation
SendGrad = _pipe.SendGrad
RecvGrad = _pipe.RecvGrad
ReduceTiedGrads = _pipe.ReduceTiedGrads
ReduceGrads = _pipe.ReduceGrads
OptimizerStep = _pipe.OptimizerStep

__all__ = [
    "BackwardPass",
    "ForwardPass",
    "InferenceSchedule",
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
]
