"""``deepspeed.checkpointing``: activation checkpointing with DeepSpeed's options, and the
model-parallel RNG tracker (``get_cuda_rng_tracker``) Megatron-style models use.

[Note: activation checkpointing]
:func:`checkpoint` runs ``function`` without keeping its activations: the forward runs under
``no_grad`` and keeps only the inputs; the backward restores the RNG states the forward saw (the
CPU generator, the accelerator's, and every state of the RNG tracker), reruns ``function`` with
gradients on, and backpropagates through that second run (DeepSpeed's reentrant design). The
saved inputs may be moved to the CPU (``checkpoint_in_cpu``) and/or split across the
model-parallel group, each rank keeping ``1/mp`` of each (``partition_activations``: the ranks of
a tensor-parallel group hold the same activations), gathered back with an all-gather before the
rerun. An empty tensor that requires grad is passed along with the inputs, so the backward runs
even when no input requires grad (the first block of a model, whose input is data): the
parameters inside still get their gradients, which a plain reentrant checkpoint loses.
:func:`non_reentrant_checkpoint` is ``torch.utils.checkpoint`` in its non-reentrant mode with the
RNG tracker restored for the rerun; it keeps the inputs where they are.

DeepSpeed's API is module-level (``configure`` once, ``checkpoint`` anywhere), so the options
and the tracker live in this module, as there.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

import ds_comm
from ds_comm.accelerator import get_accelerator
from ds_engine._config_load import load_config_dict
from ds_engine.api import ActivationCheckpointingConfig
from ds_engine.utils.logging import log_dist

__all__ = [
    "CudaRNGStatesTracker",
    "checkpoint",
    "configure",
    "get_cuda_rng_tracker",
    "is_configured",
    "model_parallel_cuda_manual_seed",
    "model_parallel_reconfigure_tp_seed",
    "non_reentrant_checkpoint",
    "reset",
    "set_num_layers",
]

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"


@dataclass
class _Options:
    """What :func:`configure` set (DeepSpeed's ``activation_checkpointing`` section)."""

    configured: bool = False
    mpu: Any = None
    partition_activations: bool = False
    contiguous_checkpointing: bool = False
    num_checkpoints: int | None = None
    checkpoint_in_cpu: bool = False
    synchronize: bool = False
    profile: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


_options = _Options()

# activation_checkpointing keys of DeepSpeed's config -> configure() argument names
_CONFIG_KEYS = {
    "partition_activations": "partition_activations",
    "contiguous_memory_optimization": "contiguous_checkpointing",
    "number_checkpoints": "num_checkpoints",
    "cpu_checkpointing": "checkpoint_in_cpu",
    "synchronize_checkpoint_boundary": "synchronize",
    "profile": "profile",
}


# --- the RNG tracker ---------------------------------------------------------------------------


class CudaRNGStatesTracker:
    """Named accelerator RNG states (DeepSpeed's and Megatron's tracker; CPU here when the
    accelerator is the CPU): :meth:`add` seeds one, :meth:`fork` runs code under it and keeps
    the advanced state for next time, leaving the default generator as it was.

    Example:
        >>> tracker = get_cuda_rng_tracker()
        >>> tracker.add("model-parallel-rng", 1234)
        >>> with tracker.fork():
        ...     x = torch.nn.functional.dropout(x, 0.1)  # the same mask on every tp rank
    """

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        """Forget every state and seed."""
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the name -> state mapping (the states themselves are shared)."""
        return copy.copy(self.states_)

    def set_states(self, states: Mapping[str, torch.Tensor]) -> None:
        """Replace the tracked states (from :meth:`get_states`)."""
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Track a new state called ``name``, seeded with ``seed`` (each name and seed once)."""
        if seed in self.seeds_:
            raise ValueError(f"RNG tracker: seed {seed} is already used; give each state its own")
        if name in self.states_:
            raise ValueError(f"RNG tracker: a state called {name!r} exists already")
        self.seeds_.add(seed)
        accelerator = get_accelerator()
        before = accelerator.get_rng_state()
        accelerator.manual_seed(seed)
        self.states_[name] = accelerator.get_rng_state()
        accelerator.set_rng_state(before)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the body with state ``name``; it advances, the default state does not."""
        if name not in self.states_:
            raise KeyError(
                f"RNG tracker: no state called {name!r} (known: {sorted(self.states_)}); add it "
                "first, e.g. with model_parallel_cuda_manual_seed(seed)"
            )
        accelerator = get_accelerator()
        before = accelerator.get_rng_state()
        accelerator.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = accelerator.get_rng_state()
            accelerator.set_rng_state(before)


_tracker = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process's RNG tracker."""
    return _tracker


def _tensor_parallel_rank() -> int:
    mpu = _options.mpu
    return 0 if mpu is None else int(mpu.get_model_parallel_rank())


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default accelerator generator with ``seed`` (the same on the ranks of a
    tensor-parallel group) and track ``"model-parallel-rng"`` seeded ``seed + 2718 + tp_rank``
    (different on each of them), as DeepSpeed and Megatron do."""
    tp_rank = _tensor_parallel_rank()
    _tracker.reset()
    get_accelerator().manual_seed(seed)
    _tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Re-seed the tracked model-parallel state with ``seed + 2718 + tp_rank``."""
    with _tracker.fork():
        get_accelerator().manual_seed(seed + 2718 + _tensor_parallel_rank())


# --- configuration -----------------------------------------------------------------------------


def _section(deepspeed_config: Any) -> dict[str, Any]:
    """The ``activation_checkpointing`` section of a config (a ``DeepSpeedConfig``, a dict, or
    a JSON / HJSON / base64 config as ``deepspeed.initialize`` takes), validated."""
    section = getattr(deepspeed_config, "activation_checkpointing", None)
    if not isinstance(section, ActivationCheckpointingConfig):
        raw = load_config_dict(deepspeed_config).get("activation_checkpointing")
        section = ActivationCheckpointingConfig.from_dict(raw)
    return {_CONFIG_KEYS[k]: getattr(section, k) for k in _CONFIG_KEYS}


def configure(
    mpu_: Any,
    deepspeed_config: Any = None,
    partition_activations: bool | None = None,
    contiguous_checkpointing: bool | None = None,
    num_checkpoints: int | None = None,
    checkpoint_in_cpu: bool | None = None,
    synchronize: bool | None = None,
    profile: bool | None = None,
) -> None:
    """Set the options of :func:`checkpoint` (DeepSpeed's): the config file's
    ``activation_checkpointing`` section first, then the arguments given (None: unchanged).

    Args:
        mpu_: the model-parallel unit (``get_model_parallel_group`` / ``_rank`` /
            ``_world_size``); needed for ``partition_activations``.
        deepspeed_config: a ``DeepSpeedConfig``, a config dict, or a config file path (JSON,
            HJSON) or base64 string.
        partition_activations: keep ``1/mp`` of each saved input per model-parallel rank.
        contiguous_checkpointing: pack the partitioned saved inputs of one forward into one
            preallocated buffer per input position (see [Note: contiguous checkpoints]);
            needs ``partition_activations`` and ``num_checkpoints``.
        num_checkpoints: number of checkpoints per forward (sizes contiguous buffers).
        checkpoint_in_cpu: keep the saved inputs in host memory.
        synchronize: synchronize the accelerator around each checkpoint's forward and backward.
        profile: log each checkpoint's forward and backward time.

    Example:
        >>> deepspeed.checkpointing.configure(None, checkpoint_in_cpu=True)
    """
    chosen = _Options(configured=True, mpu=mpu_)
    given = _section(deepspeed_config) if deepspeed_config is not None else {}
    for name, value in {
        "partition_activations": partition_activations,
        "contiguous_checkpointing": contiguous_checkpointing,
        "num_checkpoints": num_checkpoints,
        "checkpoint_in_cpu": checkpoint_in_cpu,
        "synchronize": synchronize,
        "profile": profile,
    }.items():
        if value is not None:
            given[name] = value
    for name, value in given.items():
        setattr(chosen, name, value if name == "num_checkpoints" else bool(value))
    if chosen.contiguous_checkpointing and not chosen.partition_activations:
        raise ValueError(
            "activation_checkpointing.contiguous_memory_optimization = true packs the "
            "partitioned saved inputs: it needs partition_activations = true (as DeepSpeed)"
        )
    if chosen.contiguous_checkpointing and not chosen.num_checkpoints:
        raise ValueError(
            "activation_checkpointing.contiguous_memory_optimization = true sizes one buffer "
            "per saved input by number_checkpoints: set number_checkpoints (or call "
            "set_num_layers) to the number of checkpoints in one forward"
        )
    if chosen.partition_activations and mpu_ is None:
        raise ValueError(
            "partition_activations=True splits saved activations across the model-parallel "
            "group: pass the mpu (configure(mpu_=...), or mpu= to deepspeed.initialize)"
        )
    global _options
    _options = chosen
    _contiguous.clear()


def is_configured() -> bool:
    """Whether :func:`configure` was called."""
    return _options.configured


def set_num_layers(nlayers: int) -> None:
    """Set the number of checkpoints per forward (``num_checkpoints``)."""
    _options.num_checkpoints = nlayers


def reset() -> None:
    """Start the next forward's contiguous buffers afresh (DeepSpeed's, for evaluation loops
    that run forwards with gradients but without backward); the saved inputs themselves live
    on the autograd graph and are freed with it."""
    _contiguous.clear()


# [Note: contiguous checkpoints]
# With ``partition_activations`` every checkpoint keeps a 1/mp slice of each tensor input until
# its backward, many small allocations of the same few sizes that live through the whole
# forward and die in reverse order in backward: over a long model they fragment the device
# allocator between the larger, short-lived activations. ``contiguous_memory_optimization``
# (DeepSpeed's) instead copies the slice of input ``i`` of the ``k``-th checkpoint of a forward
# into slot ``k`` of one buffer per input position ``i``, allocated at the forward's first
# checkpoint with ``number_checkpoints`` slots: one allocation per input position per forward,
# freed as a whole when the last checkpoint's backward drops its slot. (DeepSpeed allocates a
# list of ``number_checkpoints`` separate tensors instead, which keeps the allocation count but
# not the contiguity.) The first backward ends the forward's buffers: the next forward starts
# new ones, while the slots saved for the running backward keep the old ones alive.


class _ContiguousBuffers:
    """The current forward's buffers: per input position, a flat tensor and the next slot."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.next: list[int] = []

    def clear(self) -> None:
        self.buffers, self.next = [], []

    def place(self, position: int, part: torch.Tensor, slots: int) -> torch.Tensor:
        """Copy ``part`` (flat) into the next slot of position ``position``'s buffer."""
        if position == len(self.buffers):
            buffer = part.new_empty(slots * part.numel())
            self.buffers.append(buffer)
            self.next.append(0)
        buffer, k = self.buffers[position], self.next[position]
        size = buffer.numel() // slots
        if k >= slots:
            raise ValueError(
                f"activation checkpointing: more than number_checkpoints = {slots} checkpoints "
                "in one forward; raise number_checkpoints, or call "
                "deepspeed.checkpointing.reset() after a forward that ran no backward"
            )
        if part.numel() != size or part.dtype != buffer.dtype or part.device != buffer.device:
            raise ValueError(
                f"activation checkpointing: input {position} of checkpoint {k} has "
                f"{part.numel()} {part.dtype} elements on {part.device}, but the contiguous "
                f"buffer holds slots of {size} {buffer.dtype} on {buffer.device}; "
                "contiguous_memory_optimization needs every checkpoint of a forward to take "
                "inputs of the same sizes (set it to false otherwise)"
            )
        self.next[position] = k + 1
        return buffer.narrow(0, k * size, size).copy_(part)


_contiguous = _ContiguousBuffers()


# --- checkpoint --------------------------------------------------------------------------------


@dataclass
class _RngSnapshot:
    cpu: torch.Tensor
    device: torch.Tensor | None
    tracker: dict[str, torch.Tensor]

    @classmethod
    def take(cls) -> _RngSnapshot:
        accelerator = get_accelerator()
        device = None if accelerator.device_name() == "cpu" else accelerator.get_rng_state()
        return cls(
            torch.get_rng_state(), device, {k: v.clone() for k, v in _tracker.states_.items()}
        )

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            get_accelerator().set_rng_state(self.device)
        _tracker.set_states({k: v.clone() for k, v in self.tracker.items()})


@contextlib.contextmanager
def _rng_as(snapshot: _RngSnapshot) -> Iterator[None]:
    """Run with the RNG states of ``snapshot``, then put the current ones back."""
    now = _RngSnapshot.take()
    snapshot.restore()
    try:
        yield
    finally:
        now.restore()


class _Saved:
    """One saved input tensor: as is, on the CPU and/or this rank's part of it."""

    def __init__(self, t: torch.Tensor, options: _Options, position: int = 0) -> None:
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self.requires_grad = t.requires_grad
        self.group = None
        data = t.detach()
        if options.partition_activations and t.numel() > 0:
            self.group = options.mpu.get_model_parallel_group()
            size, rank = ds_comm.get_world_size(self.group), ds_comm.get_rank(self.group)
            chunk = -(-t.numel() // size)
            flat = data.reshape(-1)
            data = flat.new_zeros(chunk)
            own = flat[rank * chunk : (rank + 1) * chunk]
            data[: own.numel()].copy_(own)
        if options.checkpoint_in_cpu:
            data = data.to("cpu", copy=True)
        elif self.group is None:
            data = data.clone() if options.partition_activations else data
        if options.contiguous_checkpointing and self.group is not None:
            assert options.num_checkpoints is not None  # configure() checked
            data = _contiguous.place(position, data, options.num_checkpoints)
        self.data = data

    def load(self) -> torch.Tensor:
        data = self.data.to(self.device)
        if self.group is not None:
            size = ds_comm.get_world_size(self.group)
            whole = data.new_empty(data.numel() * size)
            ds_comm.all_gather_into_tensor(whole, data, group=self.group)
            data = whole[: self.shape.numel()].view(self.shape)
        return data.detach().requires_grad_(self.requires_grad)


class _CheckpointFunction(torch.autograd.Function):
    """See [Note: activation checkpointing]; ``anchor`` is the empty tensor that makes the
    backward run whatever the inputs."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, run: Callable[..., Any], outputs: list[Any], anchor: torch.Tensor, *args: Any
    ) -> Any:
        del anchor
        options = _options
        ctx.run, ctx.options, ctx.rng = run, options, _RngSnapshot.take()
        _sync(options)
        start = time.perf_counter()
        with torch.no_grad():
            result = run(*args)
        ctx.is_tensor = [torch.is_tensor(a) for a in args]
        ctx.plain = [None if torch.is_tensor(a) else a for a in args]
        if options.partition_activations or options.checkpoint_in_cpu:
            tensors = [a for a in args if torch.is_tensor(a)]
            ctx.saved = [_Saved(a, options, i) for i, a in enumerate(tensors)]
        else:
            ctx.saved = None
            ctx.save_for_backward(*(a for a in args if torch.is_tensor(a)))
        _sync(options)
        _profile(options, "forward", start)
        items = list(result) if isinstance(result, (tuple, list)) else [result]
        outputs.append(result)
        tensors = [t for t in items if torch.is_tensor(t)]
        ctx.mark_non_differentiable(*(t for t in tensors if not t.is_floating_point()))
        return tuple(tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        options = ctx.options
        if options.contiguous_checkpointing:
            _contiguous.clear()  # this forward's buffers end (see [Note: contiguous checkpoints])
        _sync(options)
        start = time.perf_counter()
        if ctx.saved is not None:
            tensors = [s.load() for s in ctx.saved]
        else:
            tensors = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        it = iter(tensors)
        inputs = [next(it) if flag else plain for flag, plain in zip(ctx.is_tensor, ctx.plain)]
        with _rng_as(ctx.rng), torch.enable_grad():
            result = ctx.run(*inputs)
        items = list(result) if isinstance(result, (tuple, list)) else [result]
        outs = [t for t in items if torch.is_tensor(t)]
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        _sync(options)
        _profile(options, "backward", start)
        input_grads = [t.grad if t.requires_grad else None for t in tensors]
        it = iter(input_grads)
        return (None, None, None, *(next(it) if flag else None for flag in ctx.is_tensor))


def _sync(options: _Options) -> None:
    if options.synchronize:
        get_accelerator().synchronize()


def _profile(options: _Options, phase: str, start: float) -> None:
    if options.profile:
        elapsed = (time.perf_counter() - start) * 1000
        log_dist(f"activation checkpoint {phase}: {elapsed:.3f} ms", ranks=[0])


def _with_kwargs(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """Keyword arguments passed positionally (so that tensors among them get gradients)."""
    if not kwargs:
        return function, args
    keys, count = tuple(kwargs), len(args)

    def run(*every: Any) -> Any:
        return function(*every[:count], **dict(zip(keys, every[count:])))

    return run, args + tuple(kwargs.values())


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` without keeping its activations: recomputed in backward
    with the same RNG states, with the options of :func:`configure` (see [Note: activation
    checkpointing]). Outputs may mix tensors and other values.

    Example:
        >>> hidden = deepspeed.checkpointing.checkpoint(block, hidden, attention_mask)
    """
    run, every = _with_kwargs(function, args, kwargs)
    if not torch.is_grad_enabled():
        return run(*every)
    outputs: list[Any] = []
    anchor = torch.empty(0, requires_grad=True)
    tensors = iter(_CheckpointFunction.apply(run, outputs, anchor, *every))
    result = outputs[0]
    if isinstance(result, (tuple, list)):
        return type(result)(next(tensors) if torch.is_tensor(x) else x for x in result)
    return next(tensors) if torch.is_tensor(result) else result


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """:func:`checkpoint` through ``torch.utils.checkpoint``'s non-reentrant mode (nested
    checkpoints, ``torch.autograd.grad``), with the RNG tracker restored for the rerun. The
    saved inputs stay where they are: ``partition_activations`` and ``checkpoint_in_cpu`` are
    refused here (use :func:`checkpoint`)."""
    if _options.partition_activations or _options.checkpoint_in_cpu:
        raise NotImplementedError(
            "non_reentrant_checkpoint with partition_activations or checkpoint_in_cpu is not "
            "implemented in ds; use deepspeed.checkpointing.checkpoint, which honours both"
        )
    run, every = _with_kwargs(function, args, kwargs)
    snapshot = _RngSnapshot.take()
    calls = 0

    def replay(*inputs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return run(*inputs)
        saved = _tracker.get_states()
        _tracker.set_states({k: v.clone() for k, v in snapshot.tracker.items()})
        try:
            return run(*inputs)
        finally:
            _tracker.set_states(saved)

    return torch_checkpoint.checkpoint(replay, *every, use_reentrant=False, preserve_rng_state=True)
