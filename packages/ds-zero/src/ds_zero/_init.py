"""``Init``: partition modules while they are built; ``GatheredParameters``: whole parameters for a
while (DeepSpeed's ``deepspeed.zero.Init`` and ``deepspeed.zero.GatheredParameters``).

[Note: partitioning at construction]
Inside ``Init``, the ``__init__`` of every ``torch.nn.Module`` subclass is wrapped (the classes
that exist on entry, and those defined inside through ``Module.__init_subclass__``); all is
restored on exit. When the outermost ``__init__`` of a module returns, its own parameters
(``recurse=False``) are cast to ``dtype``, broadcast from rank 0 of the group (so every rank
keeps its slice of rank 0's values whatever each rank's random state was) and partitioned by the
context's :class:`~ds_zero._partitioned.ParamPartitioner`. Parameters are partitioned straight onto the accelerator's current device
(:func:`init_device`): whole parameters are moved there before the broadcast, and the shards
are cut there, or in host memory when parameters are offloaded. Children are built (and
partitioned)
inside their parent's ``__init__``, so at any moment a rank holds the shards built so far plus
one module's whole parameters: a model larger than a rank's memory can be built.

A parent's ``__init__`` that initialises its children's weights after building them through
``self.apply(fn)`` (Hugging Face's and GPT-2's ``_init_weights`` idiom) would otherwise write
into empty partitioned tensors; inside ``Init``, ``Module.apply`` gathers each module's own
parameters around ``fn`` and keeps rank 0's result (DeepSpeed's ``override_module_apply``). Any
other write to a child's partitioned weight inside a parent's ``__init__`` needs a
:class:`GatheredParameters` with a ``modifier_rank``, as in DeepSpeed.

Nested contexts share their partitioner when they name the same group and offload; the
innermost enabled context partitions. Stage 3's optimizer takes the partitioner of the
parameters it is given (``p.ds_partitioner``).
"""

# DeepSpeed's ZeRO-3 parameter attributes (p.ds_id, p.ds_tensor, p.ds_status, ...) are set on
# torch Parameters at run time, which the type checker cannot see.
# pyright: reportAttributeAccessIssue=false

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import json
import os
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import ds_comm
from ds_comm.accelerator import get_accelerator
from ds_zero._partitioned import ParamPartitioner, ZeroParamStatus, is_partitioned
from ds_zero.api import ConfigError, OffloadParamConfig, ZeroConfig

__all__ = [
    "GatheredParameters",
    "Init",
    "register_external_parameter",
    "unregister_external_parameter",
]

_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


# --- external parameters ---------------------------------------------------------------------------


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Make stage 3 gather ``parameter`` around ``module``'s forward although ``module`` does not
    own it (e.g. a tied weight another module's forward reads). DeepSpeed's function.

    Example:
        >>> register_external_parameter(model.head, model.embed.weight)
    """
    if not isinstance(parameter, nn.Parameter):
        raise TypeError(
            f"register_external_parameter takes a torch.nn.Parameter, got {type(parameter)}"
        )
    external = module.__dict__.get("_ds_external_params")
    if external is None:
        external = []
        object.__setattr__(module, "_ds_external_params", external)  # a plain list attribute
    if not any(q is parameter for q in external):
        external.append(parameter)


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """Undo :func:`register_external_parameter`.

    Raises:
        ValueError: ``parameter`` is not registered with ``module``.
    """
    external = module.__dict__.get("_ds_external_params", [])
    for i, q in enumerate(external):
        if q is parameter:
            del external[i]
            return
    raise ValueError(
        f"the parameter of shape {tuple(getattr(parameter, 'ds_shape', parameter.shape))} is not "
        f"an external parameter of {type(module).__name__}"
    )


# --- GatheredParameters ---------------------------------------------------------------------------


class GatheredParameters:
    """Whole values of partitioned parameters inside the context; changes made on
    ``modifier_rank`` are kept on exit (DeepSpeed's ``zero.GatheredParameters``).

    Args:
        params: one parameter or an iterable of them; those not partitioned pass through.
        modifier_rank: group rank whose values are broadcast and re-partitioned on exit (None:
            changes are discarded).
        fwd_module: also register the parameters as external parameters of this module
            (:func:`register_external_parameter`), for weights read in its forward.
        enabled: False makes the context a no-op.

    Every rank of the parameters' group must enter the context (it runs collectives). Nested
    contexts work: parameters whole on entry (gathered by an outer context or a forward) stay
    whole on exit.

    Example:
        >>> with GatheredParameters(model.head.weight, modifier_rank=0):
        ...     if rank == 0:
        ...         model.head.weight.normal_(std=0.02)
    """

    def __init__(
        self,
        params: nn.Parameter | Iterable[nn.Parameter],
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        items = [params] if isinstance(params, torch.Tensor) else list(params)
        unique = list({id(p): p for p in items if is_partitioned(p)}.values())
        self.params = unique if enabled else []
        self.modifier_rank = modifier_rank
        self.fwd_module = fwd_module
        self._groups: list[tuple[ParamPartitioner, list[nn.Parameter]]] = []
        self._to_release: list[list[nn.Parameter]] = []

    def __enter__(self) -> None:
        if not self.params:
            return
        if self.fwd_module is not None:
            for p in self.params:
                register_external_parameter(self.fwd_module, p)
        by_partitioner: dict[int, tuple[ParamPartitioner, list[nn.Parameter]]] = {}
        for p in self.params:
            by_partitioner.setdefault(id(p.ds_partitioner), (p.ds_partitioner, []))[1].append(p)
        self._groups = list(by_partitioner.values())
        for partitioner, params in self._groups:
            # Only what this context gathered is released on exit (nesting, forward hooks).
            self._to_release.append(
                [p for p in params if p.ds_status is ZeroParamStatus.NOT_AVAILABLE]
            )
            partitioner.gather(params).wait()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc_type is None and self.modifier_rank is not None:
                for partitioner, params in self._groups:
                    _broadcast_whole(partitioner, params, self.modifier_rank)
                    for p in params:
                        partitioner.write_shard_from_full(p)
        finally:
            for (partitioner, _), params in zip(self._groups, self._to_release):
                partitioner.release(params)
            self._groups, self._to_release = [], []


def _broadcast_whole(
    partitioner: ParamPartitioner, params: list[nn.Parameter], group_rank: int
) -> None:
    """Every rank takes the whole values of ``params`` held by ``group_rank``."""
    if not 0 <= group_rank < partitioner.world_size:
        raise ValueError(
            f"modifier_rank = {group_rank}: expected a rank of the parameters' group "
            f"(0..{partitioner.world_size - 1})"
        )
    if partitioner.world_size == 1:
        return
    group = partitioner.group
    src = group_rank if group is None else dist.get_global_rank(group, group_rank)
    with torch.no_grad():
        works = [ds_comm.broadcast(p.data, src, group=group, async_op=True) for p in params]
        for work in works:
            if work is not None:
                work.wait()


# --- Init -----------------------------------------------------------------------------------------

# Contexts entered and not exited, innermost last. Patching classes is process-wide by nature
# (DeepSpeed's Init does the same); the stack only says which context is innermost.
_ACTIVE: list[Init] = []
_WRAPPED: list[type] = []  # classes whose __init__ is wrapped while _ACTIVE is non-empty
_SAVED: dict[str, Any] = {}  # Module attributes replaced while _ACTIVE is non-empty


def init_device() -> torch.device:
    """The device ``Init`` partitions onto: the accelerator's current device (DeepSpeed's
    ``local_device``), where gathered parameters live and, unless parameters are offloaded
    (``offload_param`` or ``remote_device``, which keep the shards in host memory), the shards."""
    return torch.device(get_accelerator().current_device_name())


def _read_config(config: Any) -> tuple[ZeroConfig | None, torch.dtype | None]:
    """``zero_optimization`` and the training dtype of a DeepSpeed config (dict or JSON path)."""
    if config is None:
        return None, None
    if isinstance(config, (str, os.PathLike)):
        with open(config, encoding="utf-8") as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise ConfigError(
            f"Init(config_dict_or_path={config!r}): expected a DeepSpeed config dict or the "
            "path of a JSON file"
        )
    zero = ZeroConfig.from_dict(config.get("zero_optimization", {}))
    dtype = None
    for key, value in _DTYPES.items():
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled") is True:
            dtype = value
    return zero, dtype


def _wrap_init(cls: type) -> None:
    """Partition a module's own parameters when its outermost ``__init__`` returns."""
    original = cls.__dict__.get("__init__")
    if not inspect.isfunction(original) or hasattr(original, "_ds_unwrapped"):
        return

    @functools.wraps(original)
    def __init__(module: nn.Module, *args: Any, **kwargs: Any) -> None:
        outermost = "_ds_in_init" not in module.__dict__
        partitioner = _ACTIVE[-1].partitioner if outermost and _ACTIVE else None
        start = len(partitioner.params) if partitioner is not None else 0
        if outermost:
            module.__dict__["_ds_in_init"] = True
        try:
            original(module, *args, **kwargs)
        finally:
            if outermost:
                del module.__dict__["_ds_in_init"]
        if outermost and _ACTIVE:
            _ACTIVE[-1]._partition_module(module)
            if partitioner is not None and _ACTIVE[-1].partitioner is partitioner:
                _forget_replaced(partitioner, start, module)

    __init__._ds_unwrapped = original  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[misc]
    _WRAPPED.append(cls)


def _forget_replaced(partitioner: ParamPartitioner, start: int, module: nn.Module) -> None:
    """Stop tracking parameters partitioned during ``module``'s ``__init__`` that are no longer
    in it: a child's weight replaced by tying (``self.head.weight = self.embed.weight``) would
    otherwise keep its shard alive in the partitioner for ever."""
    alive = {id(p) for p in module.parameters()}
    new = partitioner.params[start:]
    if any(id(p) not in alive for p in new):
        partitioner.params[start:] = [p for p in new if id(p) in alive]


def _subclasses(root: type) -> list[type]:
    found: dict[type, None] = {}
    todo = [root]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found:
                found[sub] = None
                todo.append(sub)
    return list(found)


def _init_subclass(cls: type, **kwargs: Any) -> None:
    """``Module.__init_subclass__`` inside ``Init``: classes defined there are wrapped too."""
    saved = _SAVED["__init_subclass__"]
    if saved is not None:
        saved.__get__(None, cls)(**kwargs)
    else:
        super(nn.Module, cls).__init_subclass__(**kwargs)  # type: ignore[misc]
    _wrap_init(cls)


def _apply_gathered(module: nn.Module, fn: Any) -> nn.Module:
    """``Module.apply`` inside ``Init``: ``fn`` sees each module's own parameters whole, and
    rank 0's writes are kept (see [Note: partitioning at construction])."""
    for child in module.children():
        child.apply(fn)
    with GatheredParameters(module.parameters(recurse=False), modifier_rank=0):
        fn(module)
    return module


def _patch() -> None:
    _SAVED["__init_subclass__"] = nn.Module.__dict__.get("__init_subclass__")
    _SAVED["apply"] = nn.Module.apply
    for cls in _subclasses(nn.Module):
        _wrap_init(cls)
    nn.Module.__init_subclass__ = classmethod(_init_subclass)  # type: ignore[assignment]
    nn.Module.apply = _apply_gathered  # type: ignore[method-assign]


def _unpatch() -> None:
    for cls in _WRAPPED:
        cls.__init__ = cls.__dict__["__init__"]._ds_unwrapped  # type: ignore[misc]
    _WRAPPED.clear()
    nn.Module.apply = _SAVED.pop("apply")  # type: ignore[method-assign]
    saved = _SAVED.pop("__init_subclass__")
    if saved is None:
        del nn.Module.__init_subclass__
    else:
        nn.Module.__init_subclass__ = saved  # type: ignore[assignment]


class Init(contextlib.ContextDecorator):
    """Partition the parameters of modules built inside the context, as they are built
    (DeepSpeed's ``deepspeed.zero.Init``; see [Note: partitioning at construction]).

    Without a default process group, an enabled ``Init`` creates one from the launcher's
    environment (``ds_comm.init_distributed()``; world size 1 when run alone), as DeepSpeed's
    does: scripts build the model under ``Init`` before ``deepspeed.initialize``.

    Args:
        module: an already built module to partition now (the context is then not needed).
        data_parallel_group: the group the parameters are partitioned over (None: the default
            group, or ``mpu.get_data_parallel_group()``).
        mem_efficient_linear: accepted for compatibility (linear layers need no special
            autograd function here).
        remote_device: where shards live: None/"none" (on the accelerator's current device,
            :func:`init_device`), "cpu" or "nvme"
            (needs a config with ``offload_param.nvme_path``). A config's ``offload_param``
            wins, as in DeepSpeed.
        pin_memory: page-locked host shards with ``remote_device="cpu"`` (CUDA only).
        config_dict_or_path: the DeepSpeed config (dict or JSON file): ``zero_optimization``
            gives ``offload_param``; ``bf16``/``fp16`` ``enabled`` give the dtype. Every
            parameter is partitioned, as in DeepSpeed; ``stage3_param_persistence_threshold``
            applies when the stage 3 engine takes the model (it may still be ``"auto"`` here).
        config: DeepSpeed's older name for ``config_dict_or_path``.
        enabled: False makes the context a no-op.
        dtype: cast floating-point parameters to this dtype before partitioning (None: the
            config's precision, else unchanged).
        mpu: a model-parallel unit providing ``get_data_parallel_group()``.

    Example:
        >>> with ds_zero.Init(config_dict_or_path=ds_config):
        ...     model = GPT()  # each rank holds 1/N of every large parameter
        >>> optimizer = ds_zero.Stage3Optimizer(model, torch.optim.AdamW(...), config)
    """

    def __init__(
        self,
        module: nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: dict[str, Any] | str | os.PathLike[str] | None = None,
        config: dict[str, Any] | str | os.PathLike[str] | None = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
    ) -> None:
        self.enabled = enabled
        self.partitioner: ParamPartitioner | None = None
        if not enabled:
            return
        if not dist.is_initialized():
            # As DeepSpeed's Init: scripts build the model under Init before
            # deepspeed.initialize, so the process group may not exist yet; create it from the
            # launcher's environment (world size 1 when run alone).
            ds_comm.init_distributed()
        zero, config_dtype = _read_config(
            config_dict_or_path if config_dict_or_path is not None else config
        )
        if data_parallel_group is None and mpu is not None:
            data_parallel_group = mpu.get_data_parallel_group()
        self.group = data_parallel_group
        self.dtype = dtype if dtype is not None else config_dtype
        self.offload = self._offload(zero, remote_device, pin_memory)
        # DeepSpeed's zero.Init partitions every parameter: persistence is decided when the
        # stage 3 engine takes the model, with its (by then resolved) threshold; see
        # ParamPartitioner.apply_persistence_threshold. Empty parameters stay whole.
        self.persistence_threshold = 0
        self.partitioner = self._shared_partitioner() or self._new_partitioner()
        if module is not None:
            self._partition_tree(module)

    @staticmethod
    def _offload(
        zero: ZeroConfig | None, remote_device: str | None, pin_memory: bool
    ) -> OffloadParamConfig:
        if zero is not None and zero.offload_param.enabled:
            return zero.offload_param
        device = remote_device or "none"
        if device == "nvme":
            raise ConfigError(
                'Init(remote_device="nvme") needs the directory for the shard files: pass '
                'config_dict_or_path={"zero_optimization": {"stage": 3, "offload_param": '
                '{"device": "nvme", "nvme_path": "/local_nvme"}}}'
            )
        if device not in ("none", "cpu"):
            raise ConfigError(
                f'Init(remote_device={remote_device!r}): expected None, "none", "cpu" or "nvme"'
            )
        return OffloadParamConfig(device=device, pin_memory=pin_memory)

    def _shared_partitioner(self) -> ParamPartitioner | None:
        for outer in reversed(_ACTIVE):
            part = outer.partitioner
            if (
                part is not None
                and outer.group is self.group
                and outer.offload == self.offload
                and outer.persistence_threshold == self.persistence_threshold
            ):
                return part
        return None

    def _new_partitioner(self) -> ParamPartitioner:
        store = None
        if self.offload.device == "nvme":
            from ds_zero._param_offload import NvmeShardStore

            rank = ds_comm.get_rank(self.group) if dist.is_initialized() else 0
            store = NvmeShardStore.from_config(self.offload, rank)
        return ParamPartitioner(
            self.group,
            persistence_threshold=self.persistence_threshold,
            offload=self.offload,
            shard_store=store,
            compute_device=init_device(),
        )

    def _partition_module(self, module: nn.Module) -> None:
        """Cast, broadcast from group rank 0 and partition ``module``'s own new parameters."""
        assert self.partitioner is not None
        named = [
            (n, p)
            for n, p in module.named_parameters(recurse=False)
            if not is_partitioned(p) and p.device.type != "meta"  # meta: nothing to cut yet
        ]
        if not named:
            return
        if self.dtype is not None:
            with torch.no_grad():
                for _, p in named:
                    if p.is_floating_point() and p.dtype != self.dtype:
                        p.data = p.data.to(self.dtype)
        self.partitioner.partition(
            [p for _, p in named], names=[n for n, _ in named], broadcast_from=0
        )

    def _partition_tree(self, module: nn.Module) -> None:
        for sub in module.modules():
            self._partition_module(sub)

    def __enter__(self) -> Init:
        if self.enabled:
            if not _ACTIVE:
                _patch()
            _ACTIVE.append(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.enabled:
            return
        if not _ACTIVE or _ACTIVE[-1] is not self:
            raise RuntimeError("ds_zero.Init contexts must be exited innermost first")
        _ACTIVE.pop()
        if not _ACTIVE:
            _unpatch()
            # Weights replaced during construction (tying) sit in reference cycles with their
            # bound helpers (p.all_gather, ...); free their shards now, not at some later GC.
            gc.collect()
