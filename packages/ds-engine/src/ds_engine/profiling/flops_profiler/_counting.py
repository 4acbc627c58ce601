"""Counting FLOPs and MACs at the aten level and attributing them to the module that ran them.

[Note: counting below torch.nn.functional]
DeepSpeed's profiler replaces ``torch.nn.functional.linear``, ``torch.matmul``, ``Tensor.add`` &
co. with wrappers while it profiles. Whatever does not go through a patched Python name is not
counted: ``x @ w`` on a tensor subclass, ``x * y`` and ``x + y`` written as operators (only
``torch.mul``/``Tensor.mul`` are patched), a kernel imported as ``from torch.nn.functional import
linear`` before profiling started, ``torch.rsqrt``, ``log_softmax`` inside ``cross_entropy``.

ds counts in a ``TorchDispatchMode`` instead: every aten operator the forward executes passes
through :meth:`OpCounter.__torch_dispatch__`, whatever Python spelling produced it, after
composite operators were decomposed (``linear`` arrives as ``addmm``, ``cross_entropy`` as
``_log_softmax`` + ``nll_loss_forward``), so nothing is counted twice. Two classes of operators:

- matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``, convolutions, the fused attention
  kernels ...): their FLOPs are taken from ``torch.utils.flop_counter``'s registry, the same
  numbers ``FlopCounterMode`` reports (2 FLOPs per multiply-accumulate), and MACs = FLOPs / 2;
- elementwise and normalisation operators: one FLOP per output element (DeepSpeed's convention
  for activations, ``add``, ``mul``, ``softmax``), layer/batch/group norm 5 per element with an
  affine weight and 4 without (DeepSpeed's estimate); no MACs. ``addmm``/``baddbmm`` add their
  bias: one FLOP per output element on top of the product.

Module attribution uses forward pre/post hooks: each operator is charged to the innermost module
whose forward is running, and a module's total is its own operators plus its children's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ds_comm.accelerator import get_accelerator

__all__ = ["ModuleStats", "OpCounter", "op_flops_and_macs"]

_aten = torch.ops.aten

# One FLOP per output element (both the functional and the in-place packet).
_POINTWISE_NAMES = (
    "add sub mul div neg reciprocal pow sqrt rsqrt exp exp2 expm1 log log1p log2 sin cos tanh "
    "sigmoid relu gelu silu mish elu leaky_relu hardtanh hardswish hardsigmoid softplus erf "
    "addcmul addcdiv lerp clamp clamp_min clamp_max maximum minimum where abs sign threshold "
    "prelu _prelu_kernel rrelu_with_noise"
)
# One FLOP per input element (reductions and softmax, as DeepSpeed counts softmax).
_PER_INPUT_NAMES = "_softmax _log_softmax sum mean var var_mean std norm linalg_vector_norm amax"
# ``5 * numel`` with an affine weight, ``4 * numel`` without (DeepSpeed's estimate).
_NORMS: dict[Any, int] = {}  # packet -> index of the weight argument


def _packets(names: str) -> set[Any]:
    out: set[Any] = set()
    for name in names.split():
        for variant in (name, name + "_"):
            packet = getattr(_aten, variant, None)
            if packet is not None:
                out.add(packet)
    return out


_POINTWISE = _packets(_POINTWISE_NAMES)
_PER_INPUT = _packets(_PER_INPUT_NAMES)
for _name, _weight_index in (
    ("native_layer_norm", 2),
    ("native_batch_norm", 1),
    ("_native_batch_norm_legit", 1),
    ("_native_batch_norm_legit_no_training", 1),
    ("native_group_norm", 1),
    ("_fused_rms_norm", 2),
):
    _packet = getattr(_aten, _name, None)
    if _packet is not None:
        _NORMS[_packet] = _weight_index
_BIAS_ADD = {_aten.addmm, _aten.baddbmm}


def _first_tensor(values: Iterable[Any]) -> torch.Tensor | None:
    for value in values:
        if isinstance(value, torch.Tensor):
            return value
    return None


def _numel(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel()
    if isinstance(value, (tuple, list)):
        first = _first_tensor(value)
        return first.numel() if first is not None else 0
    return 0


def op_flops_and_macs(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
) -> tuple[int, int]:
    """FLOPs and MACs of one aten call (see [Note: counting below torch.nn.functional])."""
    packet = getattr(func, "_overloadpacket", func)
    if packet in flop_registry:
        product = int(flop_registry[packet](*args, **kwargs, out_val=out))
        bias = _numel(out) if packet in _BIAS_ADD else 0
        return product + bias, product // 2
    if packet in _POINTWISE:
        return _numel(out), 0
    if packet in _PER_INPUT:
        return _numel(args[0] if args else None), 0
    if packet in _NORMS:
        index = _NORMS[packet]
        weight = args[index] if len(args) > index else None
        return _numel(args[0]) * (5 if weight is not None else 4), 0
    return 0, 0


class ModuleStats:
    """One module's own counts (its children's are not included): FLOPs, MACs, forward seconds
    and the number of forward calls."""

    __slots__ = ("_starts", "calls", "duration", "flops", "macs")

    def __init__(self) -> None:
        self.flops = 0
        self.macs = 0
        self.duration = 0.0
        self.calls = 0
        self._starts: list[float] = []


def _now() -> float:
    get_accelerator().synchronize()
    return time.perf_counter()


class OpCounter(TorchDispatchMode):
    """A dispatch mode charging every aten call to the innermost running module.

    Args:
        model: the module tree to watch.
        ignore: module types whose hooks are not installed (their operators are charged to the
            parent, as DeepSpeed's ``ignore_list`` does).
        clock: seconds, read at module entry and exit (default: synchronise the accelerator,
            then ``time.perf_counter``).
    """

    def __init__(
        self,
        model: nn.Module,
        ignore: Iterable[type] | None = None,
        clock: Callable[[], float] = _now,
    ) -> None:
        super().__init__()
        self.model = model
        self.ignore = tuple(ignore or ())
        self.clock = clock
        self.stats: dict[nn.Module, ModuleStats] = {m: ModuleStats() for m in model.modules()}
        self._stack: list[nn.Module] = []
        self._handles: list[Any] = []
        self.unattributed_flops = 0

    def attach(self) -> None:
        """Install the forward hooks (idempotent)."""
        if self._handles:
            return
        for module in self.model.modules():
            if self.ignore and isinstance(module, self.ignore):
                continue
            self.stats.setdefault(module, ModuleStats())
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._leave, always_call=True))

    def detach(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()

    def reset(self) -> None:
        """Zero every count."""
        self.stats = {m: ModuleStats() for m in self.model.modules()}
        self.unattributed_flops = 0

    def _enter(self, module: nn.Module, _inputs: Any) -> None:
        stats = self.stats.setdefault(module, ModuleStats())
        self._stack.append(module)
        stats._starts.append(self.clock())

    def _leave(self, module: nn.Module, _inputs: Any, _output: Any) -> None:
        stats = self.stats[module]
        if stats._starts:
            stats.duration += self.clock() - stats._starts.pop()
            stats.calls += 1
        if self._stack and self._stack[-1] is module:
            self._stack.pop()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flops, macs = op_flops_and_macs(func, args, kwargs, out)
        if flops or macs:
            if self._stack:
                stats = self.stats[self._stack[-1]]
                stats.flops += flops
                stats.macs += macs
            else:
                self.unattributed_flops += flops
        return out

    # --- totals over a subtree -----------------------------------------------------------------

    def flops(self, module: nn.Module) -> int:
        """FLOPs of ``module``'s forward, its children's included."""
        return sum(self.stats[m].flops for m in module.modules() if m in self.stats)

    def macs(self, module: nn.Module) -> int:
        """MACs of ``module``'s forward, its children's included."""
        return sum(self.stats[m].macs for m in module.modules() if m in self.stats)

    def duration(self, module: nn.Module) -> float:
        """Seconds in ``module``'s forward; a container never called (``ModuleList``) sums its
        children."""
        own = self.stats[module].duration if module in self.stats else 0.0
        if own == 0.0:
            return math.fsum(self.duration(child) for child in module.children())
        return own
