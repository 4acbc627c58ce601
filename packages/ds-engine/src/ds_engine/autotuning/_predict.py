"""Predicted peak bytes per rank for one candidate (ZeRO stage, micro-batch, offload).

[Note: the peak a candidate will reach]
The prediction adds terms measured once by the profile run (stage 0 at one micro-batch) to
ds-zero's estimators and its documented buffers. With ``n`` parameters of ``P`` bytes, ``K``
optimizer-state bytes per parameter, ``N`` data-parallel ranks, a reduction unit of ``U = P x
min(n, reduce_bucket_size)`` bytes and ``A(mb)`` the forward-backward window's bytes (the
profile run's peak above the bytes alive before its forward: activations, logits and their
gradients; scaled linearly with the micro-batch):

=====  ==================================================================================
stage  predicted peak per rank, on top of model states (the estimators) and resident bytes
=====  ==================================================================================
0      ``max(A, 4n)``: the window, or Adam's fp32 temporaries over the whole model
1      ``U + max(A, 8n/N)``: the reduced unit's copy; the step also copies the gradient shard
2      ``2U + max(A, 4n/N)``: two staging buffers of a unit; Adam over the shard
3      ``W + max(A, U + 4n/N)``: the gathered working set ``W = P x min(n,
       stage3_max_live_parameters)``, then the window or the reduction bucket and the step
=====  ==================================================================================

Model states are :func:`ds_zero.estimate_model_states` (stages 0-2) and
:func:`ds_zero.estimate_zero3_model_states` (stage 3), less what offload puts in host memory
where host memory is not the device. Resident bytes are what was alive outside the engine's
model states (on CPU the data set's tensors live with the model). Under offload the step's
temporaries are in host memory. ZeRO-3's prefetch can gather more than ``W`` (it re-gathers
modules still alive); on the example GPT it measured 1.4x, so stage 3 predicts a few percent
low (docs/autotuning.md has the table).
"""

from __future__ import annotations

from dataclasses import dataclass

from ds_zero import estimate_model_states, estimate_zero3_model_states

__all__ = ["Candidate", "ModelInfo", "Prediction", "ZeroKnobs", "predict_peak"]


@dataclass(frozen=True)
class ZeroKnobs:
    """The ``zero_optimization`` sizes that bound ds-zero's buffers (DeepSpeed's defaults)."""

    reduce_bucket_size: int = 500_000_000
    stage3_max_live_parameters: int = 1_000_000_000


@dataclass(frozen=True)
class Candidate:
    """One config to consider: ZeRO ``stage``, ``micro_batch`` per rank, ``offload`` of the
    optimizer state (``"none"`` or ``"cpu"``)."""

    stage: int
    micro_batch: int
    offload: str = "none"

    @property
    def name(self) -> str:
        """``z2_mb8`` or ``z2_mb8_offload``: the experiment's folder name."""
        suffix = "" if self.offload == "none" else f"_offload_{self.offload}"
        return f"z{self.stage}_mb{self.micro_batch}{suffix}"


@dataclass(frozen=True)
class ModelInfo:
    """What the profile run measured (see [Note: the peak a candidate will reach]).

    Attributes:
        num_params: parameters, shared ones once.
        largest_layer_params: parameters of the largest module (its own, not its children's).
        param_bytes: bytes per model parameter (4 fp32, 2 bf16/fp16).
        optimizer_state_bytes: optimizer state bytes per parameter (Adam 8).
        activation_bytes: the forward-backward window's peak above the bytes alive before
            the forward, at ``micro_batch``.
        micro_batch: the profile run's micro-batch.
        resident_bytes: device bytes alive outside the engine's model states (on CPU: the
            data set).
        host_is_separate: offloaded bytes leave the measured device (false on CPU, where
            host memory is the device).
    """

    num_params: int
    largest_layer_params: int
    param_bytes: int
    optimizer_state_bytes: int
    activation_bytes: int
    micro_batch: int
    resident_bytes: int = 0
    host_is_separate: bool = True

    def activations(self, micro_batch: int) -> int:
        """Activation bytes at ``micro_batch``, scaled linearly."""
        return self.activation_bytes * micro_batch // self.micro_batch


@dataclass(frozen=True)
class Prediction:
    """The terms of a predicted peak, in bytes per rank."""

    model_states: int
    buffers: int
    activations: int
    transient: int

    @property
    def total(self) -> int:
        """Predicted peak bytes per rank."""
        return self.model_states + self.buffers + self.activations + self.transient


def predict_peak(
    candidate: Candidate,
    info: ModelInfo,
    *,
    world_size: int,
    zero: ZeroKnobs | None = None,
) -> Prediction:
    """Predicted peak bytes per rank of ``candidate`` (see [Note: the peak a candidate will
    reach]).

    Example:
        >>> predict_peak(Candidate(2, 8), info, world_size=2).total
    """
    zero = zero or ZeroKnobs()
    n, p, k = info.num_params, info.param_bytes, info.optimizer_state_bytes
    offload = candidate.offload != "none"
    unit = p * min(n, zero.reduce_bucket_size)
    shard = -(-n // world_size)
    if candidate.stage == 3:
        states = estimate_zero3_model_states(
            n,
            info.largest_layer_params,
            world_size=world_size,
            param_bytes=p,
            optimizer_state_bytes=k,
            offload_optimizer=offload,
        )
        working = p * min(n, max(zero.stage3_max_live_parameters, info.largest_layer_params))
        buffers, step = working, unit + (0 if offload else 4 * shard)
    else:
        states = estimate_model_states(
            n,
            stage=candidate.stage,
            world_size=world_size,
            param_bytes=p,
            optimizer_state_bytes=k,
            offload=offload,
        )
        units = {0: 0, 1: 1, 2: 2}[candidate.stage] if world_size > 1 else 0
        per_shard = {0: 4 * n, 1: 8 * shard, 2: 4 * shard}[candidate.stage]
        buffers, step = units * unit, 0 if offload else per_shard
    activations = info.activations(candidate.micro_batch)
    return Prediction(
        model_states=states.model_states - (states.host if info.host_is_separate else 0),
        buffers=buffers + info.resident_bytes,
        activations=activations,
        transient=max(activations, step) - activations,
    )
