"""What 1-bit Adam, 0/1 Adam and 1-bit LAMB share: flat group state, averaging, checkpoints.

[Note: 1-bit optimizers reduce their own gradients]
These optimizers decide, step by step, how gradients travel: a full-precision allreduce while the
variance is still learned, a 1-bit compressed allreduce of the momentum (or gradient, or model
displacement) afterwards. So the caller hands them each rank's *local* gradient and must not
allreduce it first; the class attribute ``reduces_gradients = True`` tells an engine to skip its
data-parallel gradient reduction for them (DeepSpeed's engine instead flips its
``enable_backward_allreduce`` flag from inside the optimizer). Everything else an engine does to
gradients (unscaling fp16 grads, skipping a step when any rank overflowed) happens before
``step()`` as usual; ``max_grad_norm`` is the way to clip, since the engine only sees local
gradients. Every rank must call ``step()`` the same number of times: each call runs collectives.

[Note: flat group state]
Each param group is handled as one flat fp32 vector (:class:`FlatGroup`): the moments are flat
buffers, the compressed allreduce runs once per group over one :class:`ds_comm.CompressedAllReduce`
state (its error buffers are what make 1-bit compression converge), and the element-wise math is a
handful of large kernels instead of one per tensor. ``optimizer.state[p]`` holds views into the
flat buffers (``exp_avg``, ``exp_avg_sq``, ...), so it reads like torch's Adam state and
``state_dict()`` saves it in torch's per-parameter layout. Step counters and the compression
errors of this rank are saved under the extra ``"onebit"`` key; errors are restored only into the
same rank of a group of the same size (each rank keeps different errors and DeepSpeed saves none:
it always restarts them at zero, which costs a little accuracy for a few steps, never
correctness). A parameter whose ``.grad`` is ``None`` counts as a zero gradient, because all
ranks must run the same collectives with the same sizes.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist

import ds_comm
from ds_comm import CompressedAllReduce
from ds_optim._multi_tensor import run_closure
from ds_optim.api import ConfigError

__all__ = [
    "COMM_BACKENDS",
    "GROUP_KEYS",
    "FlatGroup",
    "OneBitOptimizer",
    "adam_denominator",
    "check_int",
    "check_number",
    "moment_correction",
]

# DeepSpeed's comm_backend_name values (and gloo): accepted for config compatibility; the
# collectives always run on whatever backend ``group`` uses.
COMM_BACKENDS = ("nccl", "mpi", "hccl", "compressed", "gloo")
# The hyperparameters every param group carries (DeepSpeed's ``defaults``).
GROUP_KEYS = ("lr", "bias_correction", "betas", "eps", "weight_decay", "max_grad_norm")
_STATE_KEY = "onebit"


# --- argument checks ------------------------------------------------------------------------------


def check_number(
    owner: str,
    key: str,
    value: Any,
    *,
    low: float = 0.0,
    high: float = math.inf,
    high_open: bool = False,
    expected: str = "",
) -> None:
    """Raise ConfigError unless ``value`` is a finite number in ``[low, high]`` (or ``[low, high)``
    with ``high_open``); ``expected`` is appended to the message."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and low <= value and (value < high if high_open else value <= high)
    if not ok:
        bound = f"< {high}" if high_open else f"<= {high}"
        range_text = f">= {low}" if high == math.inf else f">= {low} and {bound}"
        raise ConfigError(f"{owner}: {key}={value!r}: expected a number {range_text}{expected}")


def check_int(owner: str, key: str, value: Any, *, low: int, meaning: str) -> None:
    """Raise ConfigError unless ``value`` is an integer ``>= low``; ``meaning`` says what it is."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"{owner}: {key}={value!r}: expected an integer >= {low} ({meaning})")


def reject_amsgrad(owner: str, amsgrad: Any) -> None:
    """These optimizers freeze one variance: there is no AMSGrad variant to offer."""
    if amsgrad is not False:
        raise ConfigError(
            f"{owner}: amsgrad={amsgrad!r}: the AMSGrad variant is not supported (the variance "
            "is frozen after warmup); set amsgrad to false"
        )


def _check_group_hyperparameters(owner: str, group: Mapping[str, Any]) -> None:
    check_number(owner, "lr", group["lr"])
    check_number(owner, "eps", group["eps"])
    check_number(owner, "weight_decay", group["weight_decay"])
    check_number(owner, "max_grad_norm", group["max_grad_norm"], expected=" (0 disables clipping)")
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ConfigError(f"{owner}: betas={betas!r}: expected two numbers such as [0.9, 0.999]")
    for i, beta in enumerate(betas):
        check_number(owner, f"betas[{i}]", beta, high=1.0, high_open=True)
    if not isinstance(group["bias_correction"], bool):
        raise ConfigError(
            f"{owner}: bias_correction={group['bias_correction']!r}: expected true or false"
        )
    mask = group.get("exp_avg_mask")
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise ConfigError(
            f"{owner}: exp_avg_mask={type(mask).__name__}: expected a tensor of 0/1 with as many "
            "elements as the group's parameters together"
        )


# --- Adam arithmetic ------------------------------------------------------------------------------


def moment_correction(group: Mapping[str, Any], beta: float, count: int) -> float:
    """``1 - beta**count`` when the group corrects bias (and ``count > 0``), else 1."""
    return 1.0 - beta**count if group["bias_correction"] and count > 0 else 1.0


def adam_denominator(
    exp_avg_sq: torch.Tensor, correction2: float, eps: float, eps_inside_sqrt: bool
) -> torch.Tensor:
    """``sqrt(v_hat) + eps``, or ``sqrt(v_hat + eps)`` with ``eps_inside_sqrt``; a new tensor.

    ``v_hat = v / correction2``; the order of operations is torch Adam's, so the warmup phase
    matches ``torch.optim.Adam`` to rounding.
    """
    if eps_inside_sqrt:
        return exp_avg_sq.div(correction2).add_(eps).sqrt_()
    return exp_avg_sq.sqrt().div_(math.sqrt(correction2)).add_(eps)


# --- one param group as a flat vector -------------------------------------------------------------


class FlatGroup:
    """A param group seen as one flat fp32 vector; see [Note: flat group state].

    Args:
        params: the group's parameters (all on one device; empty tensors left out).
        state: the optimizer's per-parameter state, which receives views of the flat buffers.
    """

    def __init__(self, params: list[torch.Tensor], state: Mapping[torch.Tensor, dict]) -> None:
        devices = {p.device for p in params}
        if len(devices) != 1:
            raise ValueError(
                f"a param group must live on one device, found {sorted(map(str, devices))}"
            )
        self.params = params
        self.device = params[0].device
        self.sizes = [p.numel() for p in params]
        self.numel = sum(self.sizes)
        self.lengths = torch.tensor(self.sizes, device=self.device)
        self.buffers: dict[str, torch.Tensor] = {}
        self.counters: dict[str, float] = {}
        self.comm: CompressedAllReduce | None = None
        self._state = state

    def buffer(self, name: str, *, per_param: bool = False, fill: float = 0.0) -> torch.Tensor:
        """The flat buffer ``name`` (one element per parameter element, or per parameter),
        created filled with ``fill`` on first use; ``state[p][name]`` views it."""
        flat = self.buffers.get(name)
        if flat is None:
            size = len(self.params) if per_param else self.numel
            flat = torch.full((size,), fill, dtype=torch.float32, device=self.device)
            self.buffers[name] = flat
            views = flat.unbind() if per_param else self.views(flat)
            for p, view in zip(self.params, views):
                self._state[p][name] = view
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of a flat vector, each shaped like its parameter."""
        return [
            chunk.view_as(p) for chunk, p in zip(flat.split(self.sizes), self.params, strict=True)
        ]

    def gather_grads(self) -> torch.Tensor:
        """This rank's gradients as one new fp32 vector (a missing ``.grad`` counts as zero)."""
        out = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        for chunk, p in zip(out.split(self.sizes), self.params, strict=True):
            if p.grad is not None:
                if p.grad.is_sparse:
                    raise RuntimeError("1-bit optimizers do not support sparse gradients")
                chunk.copy_(p.grad.reshape(-1))
        return out

    def gather_params(self) -> torch.Tensor:
        """The parameters as one new fp32 vector."""
        return torch.cat([p.detach().reshape(-1).float() for p in self.params])

    def add_to_params(
        self, flat: torch.Tensor, alpha: float, scales: torch.Tensor | None = None
    ) -> None:
        """``p += alpha * scales[i] * flat_i`` for every parameter ``i`` (``scales`` per param)."""
        update = self.views(flat)
        if scales is not None:
            update = torch._foreach_mul(update, scales.tolist())
        torch._foreach_add_(self.params, update, alpha=alpha)

    def scale_params(self, factor: float) -> None:
        """``p *= factor`` for every parameter (decoupled weight decay)."""
        if factor != 1.0:
            torch._foreach_mul_(self.params, factor)

    def copy_to_params(self, flat: torch.Tensor) -> None:
        """Overwrite the parameters with a flat vector."""
        for p, view in zip(self.params, self.views(flat), strict=True):
            p.copy_(view)

    def norms(self, flat: torch.Tensor) -> torch.Tensor:
        """Per-parameter L2 norms of a flat vector."""
        return torch.stack(torch._foreach_norm(self.views(flat)))

    def maxima(self, flat: torch.Tensor) -> torch.Tensor:
        """Per-parameter maxima of a flat vector."""
        return torch.segment_reduce(flat, "max", lengths=self.lengths)

    def expand(self, per_param: torch.Tensor) -> torch.Tensor:
        """A per-parameter vector repeated over each parameter's elements (a new flat vector)."""
        return torch.repeat_interleave(per_param, self.lengths, output_size=self.numel)


# --- the shared optimizer base --------------------------------------------------------------------


class OneBitOptimizer(torch.optim.Optimizer):
    """Base of :class:`OneBitAdam`, :class:`ZeroOneAdam` and :class:`OneBitLamb`.

    Subclasses set the buffer declarations and implement :meth:`_step_group`; this class owns the
    flat group state, the two kinds of averaging and ``state_dict`` handling.
    """

    reduces_gradients: ClassVar[bool] = True
    """The optimizer averages gradients over its process group itself: an engine must hand it
    local gradients and skip its own data-parallel allreduce (see
    [Note: 1-bit optimizers reduce their own gradients])."""

    _ELEMENT_BUFFERS: ClassVar[tuple[str, ...]] = ("exp_avg", "exp_avg_sq")
    _LAZY_BUFFERS: ClassVar[tuple[str, ...]] = ()  # element buffers created when needed
    _PARAM_BUFFERS: ClassVar[Mapping[str, float]] = {}  # per-parameter scalars and their start
    _COUNTERS: ClassVar[Mapping[str, float]] = {"step": 0}

    def __init__(self, arguments: Mapping[str, Any], *, group_keys: tuple[str, ...] = ()) -> None:
        """Validate and store a subclass constructor's ``arguments`` (its ``locals()``, by
        DeepSpeed's names); the hyperparameters in :data:`GROUP_KEYS` and ``group_keys`` become
        the param groups' defaults."""
        owner = type(self).__name__
        reject_amsgrad(owner, arguments["amsgrad"])
        comm_backend_name = arguments["comm_backend_name"]
        if comm_backend_name not in COMM_BACKENDS:
            raise ConfigError(
                f"{owner}: comm_backend_name={comm_backend_name!r}: expected one of "
                f"{list(COMM_BACKENDS)} (the collectives use the backend of `group` either way)"
            )
        for key in ("cuda_aware", "eps_inside_sqrt"):
            if not isinstance(arguments[key], bool):
                raise ConfigError(f"{owner}: {key}={arguments[key]!r}: expected true or false")
        defaults = {key: arguments[key] for key in (*GROUP_KEYS, *group_keys)}
        super().__init__(arguments["params"], defaults)
        group = arguments["group"]
        self.process_group = group
        self.eps_inside_sqrt: bool = arguments["eps_inside_sqrt"]
        self.comm_backend_name: str = comm_backend_name
        self.cuda_aware: bool = arguments["cuda_aware"]
        if dist.is_available() and dist.is_initialized():
            self.world_size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
        elif group is None:
            self.world_size, self.rank = 1, 0  # a single process without a process group
        else:
            raise ConfigError(f"{owner}: group given but no default process group is initialised")
        self._flat: dict[int, FlatGroup] = {}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (validated like the constructor's hyperparameters)."""
        super().add_param_group(param_group)
        self._check_group(self.param_groups[-1])

    def _check_group(self, group: Mapping[str, Any]) -> None:
        _check_group_hyperparameters(type(self).__name__, group)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step on every param group; runs collectives, so all ranks must call it.

        Args:
            closure: re-evaluates the model and returns the loss (optional).
        """
        loss = run_closure(closure)
        for index, group in enumerate(self.param_groups):
            flat = self._flat_group(index)
            if flat is not None:
                self._step_group(flat, group)
        return loss

    def _step_group(self, flat: FlatGroup, group: dict[str, Any]) -> None:
        raise NotImplementedError  # each algorithm implements its step over one flat group

    def _flat_group(self, index: int) -> FlatGroup | None:
        flat = self._flat.get(index)
        if flat is None:
            params = [p for p in self.param_groups[index]["params"] if p.numel() > 0]
            if not params:
                return None
            flat = self._flat[index] = FlatGroup(params, self.state)
            for name in self._ELEMENT_BUFFERS:
                flat.buffer(name)
            for name, fill in self._PARAM_BUFFERS.items():
                flat.buffer(name, per_param=True, fill=fill)
            flat.counters.update(self._COUNTERS)
        return flat

    # --- communication ---

    def _average(self, tensor: torch.Tensor) -> None:
        """Full-precision mean over the process group, in place."""
        if self.world_size > 1:
            ds_comm.all_reduce(tensor, group=self.process_group)
            tensor.div_(self.world_size)

    def _compressed_average(self, flat: FlatGroup, tensor: torch.Tensor) -> None:
        """1-bit mean over the process group with the group's error feedback, in place."""
        if self.world_size > 1:
            self._compressed_state(flat).compress_all_reduce(tensor)

    @staticmethod
    def _mask_(tensor: torch.Tensor, group: dict[str, Any]) -> None:
        """Multiply by the group's ``exp_avg_mask`` (DeepSpeed's momentum mask), if it has one."""
        mask = group.get("exp_avg_mask")
        if mask is None:
            return
        if mask.numel() != tensor.numel():
            raise ValueError(
                f"exp_avg_mask has {mask.numel()} elements but the group's parameters have "
                f"{tensor.numel()}: give one 0/1 entry per parameter element"
            )
        if mask.device != tensor.device:
            group["exp_avg_mask"] = mask = mask.to(tensor.device)
        tensor.mul_(mask.reshape(-1))

    @staticmethod
    def _clip_(grad: torch.Tensor, group: dict[str, Any]) -> None:
        """Scale ``grad`` down to the group's ``max_grad_norm`` (when > 0), in place."""
        max_norm = group["max_grad_norm"]
        if max_norm > 0:
            norm = torch.linalg.vector_norm(grad)
            grad.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0))

    @staticmethod
    def _decay_and_add(
        flat: FlatGroup, group: dict[str, Any], direction: torch.Tensor, step_size: float
    ) -> None:
        """``p = p * (1 - lr * weight_decay) - step_size * direction`` (decoupled weight decay,
        DeepSpeed's ``update += weight_decay * p; p -= lr * update``)."""
        flat.scale_params(1.0 - group["lr"] * group["weight_decay"])
        flat.add_to_params(direction, alpha=-step_size)

    # --- checkpoints ---

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict plus this rank's counters and compression errors (``"onebit"``)."""
        state_dict = super().state_dict()
        groups: list[dict[str, Any] | None] = []
        for index in range(len(self.param_groups)):
            flat = self._flat.get(index)
            if flat is None:
                groups.append(None)
                continue
            errors = None
            if flat.comm is not None:
                errors = {"worker": flat.comm.worker_error, "server": flat.comm.server_error}
            groups.append({"counters": dict(flat.counters), "errors": errors})
        state_dict[_STATE_KEY] = {
            "world_size": self.world_size,
            "rank": self.rank,
            "groups": groups,
        }
        return state_dict

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict`; the current ``exp_avg_mask`` is kept.

        Compression errors come back only on the same rank of a group of the same size;
        otherwise they restart at zero (see [Note: flat group state]).
        """
        state_dict = dict(state_dict)
        extra = state_dict.pop(_STATE_KEY, None)
        if extra is None:
            raise ValueError(
                f"state dict has no {_STATE_KEY!r} entry: it was not saved by "
                f"{type(self).__name__}.state_dict()"
            )
        # DeepSpeed keeps the masks the training script set, not the checkpoint's.
        masks = [group.get("exp_avg_mask") for group in self.param_groups]
        saved_groups = [dict(g) for g in state_dict["param_groups"]]
        for saved in saved_groups:
            saved.pop("exp_avg_mask", None)
        state_dict["param_groups"] = saved_groups
        super().load_state_dict(state_dict)
        for group, mask in zip(self.param_groups, masks):
            if mask is not None:
                group["exp_avg_mask"] = mask
        self._flat.clear()
        same_place = extra["world_size"] == self.world_size and extra["rank"] == self.rank
        for index, saved in enumerate(saved_groups):
            self._restore_group(
                index, saved["params"], state_dict["state"], extra["groups"][index], same_place
            )

    def _restore_group(
        self,
        index: int,
        saved_ids: list[int],
        saved_state: Mapping[int, Mapping[str, Any]],
        extra: Mapping[str, Any] | None,
        same_place: bool,
    ) -> None:
        params = self.param_groups[index]["params"]
        for p in params:
            self.state.pop(p, None)  # replaced by views of fresh flat buffers below
        if extra is None:
            return  # this group had not stepped yet
        flat = self._flat_group(index)
        assert flat is not None
        known = {*self._ELEMENT_BUFFERS, *self._LAZY_BUFFERS, *self._PARAM_BUFFERS}
        position = {id(p): i for i, p in enumerate(flat.params)}
        for param_id, p in zip(saved_ids, params, strict=True):
            if id(p) not in position:
                continue  # an empty tensor: no state
            for name, value in saved_state.get(param_id, {}).items():
                if name not in known:
                    raise ValueError(
                        f"state dict holds {name!r} for parameter {param_id}, which "
                        f"{type(self).__name__} does not keep: was it saved by another optimizer?"
                    )
                per_param = name in self._PARAM_BUFFERS
                target = flat.buffer(name, per_param=per_param)
                slot = position[id(p)]
                view = target[slot] if per_param else flat.views(target)[slot]
                view.copy_(value)
        flat.counters.update(extra["counters"])
        errors = extra.get("errors")
        if errors is not None and self.world_size > 1:
            if same_place:
                comm = self._compressed_state(flat)
                comm.worker_error.copy_(errors["worker"])
                comm.server_error.copy_(errors["server"])
            else:
                warnings.warn(
                    f"{type(self).__name__}: the checkpoint's compression errors belong to "
                    f"another rank or world size; they restart at zero",
                    stacklevel=3,
                )

    def _compressed_state(self, flat: FlatGroup) -> CompressedAllReduce:
        if flat.comm is None:
            flat.comm = CompressedAllReduce(
                flat.numel, group=self.process_group, device=flat.device
            )
        return flat.comm
