"""One model parameter's fp32 master, optimizer state and gradient inside a ZeRO optimizer, read
and written by parameter (DeepSpeed's ``safe_get_full_fp32_param`` family sits on this).

[Note: parameter views]
Every ZeRO optimizer keeps a parameter's training state somewhere else than the parameter: the
fp32 master values and the elementwise optimizer state live in flat partitions, the gradient in
a flat buffer or shard. :func:`param_views` finds, for one parameter, the range
``[start, stop)`` of its flattened elements that this rank holds, and the views of that range in
each of those tensors:

- stages 0-2 (``ZeroOptimizer``, see [Note: flat layout] and [Note: tensor shards of the flat
  layout]): the parameter sits at ``offset`` in a unit whose shard of ``s`` elements rank ``r``
  owns; the held range is the overlap of ``[offset, offset + numel)`` with ``[r * s, (r + 1) *
  s)``. The master and state are read at ``unit.shard_start + begin - r * s``; the gradient at
  the same place in the stage 2 / offload shard, or at ``unit.start + begin`` in the flat buffer
  of stages 0/1 (stage 1 reduces into exactly the own slice of that buffer, the rest holds
  unreduced local values). Replicated groups (stage 0, one rank) hold the whole parameter.
- stage 3 (``Stage3Optimizer``, see [Note: stage 3 step]): the parameter's own slot of
  ``ceil(numel / world)`` elements (the partition, padding included) in its sub-group's master,
  state and gradient shard; the unpadded range is :func:`~ds_zero._partitioned.shard_bounds`.

A *full* value is assembled by an all-reduce (sum) of zero buffers into which each rank copied
its range (ranges are disjoint and cover the parameter; replicated groups need no collective),
so full getters are collectives of the parameter's data-parallel group: every rank calls them,
in the same order. Full setters take the whole value on every rank and write the own range, and
the model's copy of the parameter follows at once (its whole value where a rank holds it
whole); local setters write only the own range, and other ranks' copies of the model weight
follow at the next step (as DeepSpeed's, whose low-precision weights follow the masters only at
the step). Gradients are the stored ones: scaled by the loss scale with fp16, divided by the
accumulation steps, reduced over the group only at the accumulation boundary (stages 0/1) and
only between a backward and the step after it (which zeroes them).

The optimizer is found from the parameter through a registry of weak references that every ZeRO
optimizer fills at construction: DeepSpeed's functions take only the parameter.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

import ds_comm

__all__ = ["ParamViews", "param_views", "register_param_owner"]

_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_RESERVED = ("param", "grad")


def register_param_owner(optimizer: Any, params: Iterable[torch.nn.Parameter]) -> None:
    """Record ``optimizer`` as the ZeRO optimizer training ``params`` (weakly: neither is kept
    alive by the record). Called by the ZeRO optimizers' constructors."""
    ref = weakref.ref(optimizer)
    for p in params:
        _OWNERS[p] = ref


def param_views(param: torch.Tensor) -> ParamViews | None:
    """The views of ``param`` in the ZeRO optimizer training it, or None when no live ZeRO
    optimizer trains it (a frozen parameter, a plain torch model). See [Note: parameter views].

    Example:
        >>> views = ds_zero.param_views(model.fc.weight)
        >>> views.full("exp_avg")  # collective: every rank of the data-parallel group
    """
    ref = _OWNERS.get(param)
    owner = ref() if ref is not None else None
    if owner is None:
        return None
    if hasattr(owner, "_slots"):  # Stage3Optimizer
        return _stage3_views(owner, param)
    return _flat_views(owner, param)


class ParamViews:
    """Where one parameter's training state lives on this rank (see [Note: parameter views]).

    ``kind`` names what to read or write: ``"param"`` (the fp32 master values), ``"grad"`` (the
    gradient, in the dtype it is accumulated in) or an elementwise optimizer state key such as
    ``"exp_avg"``.

    Attributes:
        param: the model parameter.
        start: first element of the flattened parameter held by this rank.
        stop: one past the last (``start == stop``: none held).
        replicated: every rank holds the whole parameter (no collective needed).
        group: the process group the parameter is sharded over.
    """

    def __init__(
        self,
        param: torch.Tensor,
        *,
        start: int,
        stop: int,
        replicated: bool,
        group: Any,
        backend: _Backend,
    ) -> None:
        self.param, self.start, self.stop = param, start, stop
        self.replicated, self.group = replicated, group
        self._backend = backend

    @property
    def numel(self) -> int:
        """The parameter's element count (its full, unpartitioned size)."""
        return self._backend.numel

    @property
    def shape(self) -> torch.Size:
        """The parameter's full shape."""
        return self._backend.shape

    def local(self, kind: str = "param") -> torch.Tensor | None:
        """This rank's piece of ``kind``: a 1-D view into the optimizer's storage (a copy when
        the state lives on NVMe), or None for a gradient that does not exist (after the step).

        Stage 3 returns the whole partition slot (``ceil(numel / world)`` elements, padding
        included, as ``p.ds_tensor``); stages 0-2 the ``stop - start`` held elements.
        """
        with self._backend.resident():
            view = self._backend.view(kind)
            if view is not None and self._backend.swapped:
                view = view.clone()
            return view

    def set_local(self, kind: str, value: torch.Tensor) -> None:
        """Overwrite this rank's piece of ``kind`` (shaped as :meth:`local` returns it)."""
        with self._backend.resident():
            view = self._backend.view(kind, create_grad=True)
            assert view is not None
            if value.numel() != view.numel():
                raise ValueError(
                    f"{self._backend.name}: the local {kind!r} holds {view.numel()} elements on "
                    f"this rank, the value has {value.numel()}; pass a tensor of local(...)'s size"
                )
            with torch.no_grad():
                view.copy_(value.detach().reshape(-1))
            if kind == "param":
                self._backend.after_local_param_write()

    def full(self, kind: str = "param") -> torch.Tensor:
        """The whole ``kind`` (fp32, shaped like the parameter); a collective over
        :attr:`group` unless :attr:`replicated`. A missing gradient reads as zeros."""
        with self._backend.resident():
            view = self._backend.view(kind)
            held = self.stop - self.start
            if self.replicated:
                if view is None:
                    return torch.zeros(self.shape, dtype=torch.float32, device=self._device)
                # a copy, as the sharded case returns: a full value never aliases the storage
                whole = view.narrow(0, 0, held).to(self._device, torch.float32, copy=True)
                return whole.view(self.shape)
            out = torch.zeros(self.numel, dtype=torch.float32, device=self._device)
            if view is not None and held:
                out.narrow(0, self.start, held).copy_(view.narrow(0, 0, held))
        ds_comm.all_reduce(out, group=self.group)
        return out.view(self.shape)

    def set_full(self, kind: str, value: torch.Tensor) -> None:
        """Write the own range of the whole ``value`` (the same on every rank) into ``kind``;
        with ``"param"`` the model's weight follows. Not a collective."""
        if value.numel() != self.numel:
            raise ValueError(
                f"{self._backend.name}: the parameter has shape {tuple(self.shape)} and the value "
                f"{tuple(value.shape)}; pass the whole (unpartitioned) value"
            )
        flat = value.detach().reshape(-1)
        held = self.stop - self.start
        with self._backend.resident():
            view = self._backend.view(kind, create_grad=True)
            assert view is not None
            with torch.no_grad():
                view.narrow(0, 0, held).copy_(flat.narrow(0, self.start, held))
            if kind == "param":
                self._backend.after_full_param_write(flat)

    @property
    def _device(self) -> torch.device:
        return self._backend.device


class _Backend:
    """What a ZeRO optimizer kind provides to :class:`ParamViews`."""

    name: str
    numel: int
    shape: torch.Size
    device: torch.device
    swapped: bool = False

    def view(self, kind: str, *, create_grad: bool = False) -> torch.Tensor | None:
        raise NotImplementedError

    def resident(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def after_local_param_write(self) -> None:
        raise NotImplementedError

    def after_full_param_write(self, flat: torch.Tensor) -> None:
        raise NotImplementedError


def _state_view(
    optimizer: torch.optim.Optimizer, master: torch.Tensor, key: str, name: str
) -> torch.Tensor:
    if key in _RESERVED:
        raise AssertionError(key)
    state = optimizer.state.get(master, {})
    value = state.get(key)
    if not (torch.is_tensor(value) and value.shape == master.shape):
        keys = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.shape == master.shape)
        raise KeyError(
            f"{name}: no elementwise optimizer state {key!r}; this optimizer holds {keys} (state "
            "exists only after the first step)"
        )
    return value


# --- stages 0-2 --------------------------------------------------------------------------------


class _FlatBackend(_Backend):
    def __init__(self, zero: Any, param: torch.Tensor) -> None:
        for group in zero.groups:
            for unit in group.units:
                for index, p in enumerate(unit.params):
                    if p is param:
                        self._locate(zero, group, unit, index)
                        return
        raise KeyError("parameter not in the optimizer's layout")

    def _locate(self, zero: Any, group: Any, unit: Any, index: int) -> None:
        self.zero, self.group, self.unit, self.index = zero, group, unit, index
        p = unit.params[index]
        self.name = _name_of(zero, group, unit, index)
        self.numel, self.shape, self.device = p.numel(), p.shape, p.device
        offset, s = unit.offsets[index], unit.shard_numel
        rank = zero._shard_rank(group) if unit.num_shards > 1 else 0
        low = rank * s if unit.num_shards > 1 else 0
        high = low + s if unit.num_shards > 1 else unit.padded_numel
        self.begin, self.end = max(low, offset), min(high, offset + p.numel())
        if self.begin >= self.end:  # nothing held: an empty range at the shard's start
            self.begin = self.end = low
            offset = low
        self.start, self.stop = self.begin - offset, self.end - offset
        self.in_partition = unit.shard_start + self.begin - low
        self.swapped = zero._swap is not None

    @property
    def held(self) -> int:
        return self.end - self.begin

    def resident(self) -> contextlib.AbstractContextManager[None]:
        return _swapped_in(self.zero._swap)

    def view(self, kind: str, *, create_grad: bool = False) -> torch.Tensor | None:
        master = self.zero.masters[self.group.index]
        if kind == "param":
            return master.narrow(0, self.in_partition, self.held)
        if kind == "grad":
            reducer = self.zero.reducer
            reducer.ensure_allocated()  # freed between steps on an accelerator
            part = reducer.part[self.group.index]
            if part is not None:
                return part.narrow(0, self.in_partition, self.held)
            full = reducer.full[self.group.index]
            return full.narrow(0, self.unit.start + self.begin, self.held)
        value = _state_view(self.zero.optimizer, master, kind, self.name)
        return value.narrow(0, self.in_partition, self.held)

    def _lp(self) -> torch.Tensor:
        return self.group.flat.narrow(
            0, self.unit.start + self.unit.offsets[self.index], self.numel
        )

    def after_local_param_write(self) -> None:
        if self.zero._master_is_flat:  # the master is the model's weight
            return
        with torch.no_grad():
            lp = self._lp().narrow(0, self.start, self.held)
            lp.copy_(self.view("param"))  # type: ignore[arg-type]

    def after_full_param_write(self, flat: torch.Tensor) -> None:
        if self.zero._master_is_flat:
            return
        with torch.no_grad():
            self._lp().copy_(flat)


def _name_of(zero: Any, group: Any, unit: Any, index: int) -> str:
    position = 0
    for u in group.units:
        if u is unit:
            return group.names[position + index] if group.names else "parameter"
        position += len(u.params)
    return "parameter"


@contextlib.contextmanager
def _swapped_in(swap: Any) -> Iterator[None]:
    if swap is None:
        yield
        return
    swap.swap_in()
    try:
        yield
    finally:
        swap.swap_out()


def _flat_views(zero: Any, param: torch.Tensor) -> ParamViews:
    backend = _FlatBackend(zero, param)
    ctx = zero._contexts[backend.group.index]
    return ParamViews(
        param,
        start=backend.start,
        stop=backend.stop,
        replicated=backend.unit.num_shards == 1 or ctx.world_size == 1,
        group=ctx.group,
        backend=backend,
    )


# --- stage 3 -----------------------------------------------------------------------------------


class _Stage3Backend(_Backend):
    def __init__(self, zero: Any, param: Any) -> None:
        from ds_zero._partitioned import shard_bounds

        self.zero, self.p = zero, param
        self.slot = zero._slots[id(param)]
        self.name = zero.names.get(id(param), "parameter")
        self.numel, self.shape = param.ds_numel, torch.Size(param.ds_shape)
        self.device = param.device
        self.start, self.stop = shard_bounds(param.ds_numel, zero.world_size, zero.rank)
        self.swapped = zero._swap is not None  # ZeRO-Infinity: the state is on NVMe

    def resident(self) -> contextlib.AbstractContextManager[None]:
        return _swapped_in(self.zero._swap)

    def view(self, kind: str, *, create_grad: bool = False) -> torch.Tensor | None:
        slot = self.slot
        if kind == "grad":
            grad = self.zero.grad_shards[slot.index]
            if grad is None and create_grad:
                grad = self.zero.reducer.grad_shard(slot.index)
            return None if grad is None else grad.narrow(0, slot.offset, slot.numel)
        master = self.zero.masters[slot.index]
        if kind != "param":
            master = _state_view(self.zero.optimizer, master, kind, self.name)
        return master.narrow(0, slot.offset, slot.numel)

    def after_local_param_write(self) -> None:
        self._write_shard()

    def _write_shard(self) -> None:
        if self.slot.aliased:
            return
        store = self.zero.partitioner.shard_store
        if store is not None:
            store.fetch([self.p])
        with torch.no_grad():
            self.p.ds_tensor.copy_(self.view("param"))  # type: ignore[arg-type]
        if store is not None:
            store.evict([self.p])

    def after_full_param_write(self, flat: torch.Tensor) -> None:
        from ds_zero._partitioned import ZeroParamStatus

        self._write_shard()
        if self.p.ds_status is ZeroParamStatus.AVAILABLE:  # whole here (persistent or gathered)
            with torch.no_grad():
                self.p.data.copy_(flat.view(self.shape))


def _stage3_views(zero: Any, param: torch.Tensor) -> ParamViews:
    backend = _Stage3Backend(zero, param)
    return ParamViews(
        param,
        start=backend.start,
        stop=backend.stop,
        replicated=zero.world_size == 1,
        group=zero.group,
        backend=backend,
    )
